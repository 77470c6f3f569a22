import time, torch
from dspark.runner.models.loader import load_target_model
from dspark.training.trainer import new_drafter, drafter_loss
from dspark.training.losses import LossWeights
from dspark.training.data import TrainBatch
from dspark.spec.draft_vocab import load_draft_vocab
from dspark.config import DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR
torch.manual_seed(0); torch.set_num_threads(2)
target = load_target_model(DEFAULT_TARGET_DIR, dtype=torch.float32, device=torch.device("cpu")).requires_grad_(False)
vocab = load_draft_vocab(DEFAULT_DRAFT_DIR, 0, 49152)
drafter = new_drafter(target.config, 7, 1, 32, 3, 0)
B, T, A = 2, 192, 16
ids = torch.randint(0, 49000, (B, T))
batch = TrainBatch(ids, torch.full((B,), T), torch.randint(1, T - 10, (B, A)), torch.ones(B, A, dtype=torch.bool))
for rep in range(4):
    for name, v in (("full", None), ("K8192", vocab)):
        t0 = time.perf_counter()
        parts = drafter_loss(target, drafter, batch, LossWeights(), False, v)
        t1 = time.perf_counter()
        parts.total.backward(); drafter.zero_grad()
        t2 = time.perf_counter()
        print(f"{name:6s} forward {t1-t0:.3f} backward {t2-t1:.3f} total {t2-t0:.3f}", flush=True)
