"""Which block keeps a dropped target-graph pool alive; does a capture into it assert (old) or not (new)."""

import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, "tests")
from tiny_models import write_tiny_drafter, write_tiny_target  # noqa: E402

from dspark import LLM, EngineConfig, SamplingParams  # noqa: E402
from dspark.cuda_graphs import CudaGraphs  # noqa: E402

mode = sys.argv[1]
if mode == "old":
    CudaGraphs._drop_captured = lambda self: self.captured.clear()
torch.cuda.memory._record_memory_history(stacks="python", max_entries=100000)
d = Path(tempfile.mkdtemp())
t = write_tiny_target(d / "t")
dr = write_tiny_drafter(t, d / "d")
config = EngineConfig(
    model=str(t),
    draft_model=str(dr),
    spec_mode="compact",
    num_kv_pages=256,
    kv_page_size=4,
    max_num_seqs=3,
    max_num_batched_tokens=24,
    device="cuda",
    dtype="float32",
    cuda_graph_max_tokens=32,
    adaptive_speculation=False,
)
llm = LLM(config)
runner = llm.engine.runner
pool = tuple(runner.graphs.pool)
print("target pool", pool, "draft pool", tuple(llm.engine.proposer.graphs.pool))
runner.set_feature_sink(runner.feature_sink)  # drops the start-up graphs, as the test's recorder does
gc.collect()
torch.cuda.synchronize()
torch.cuda.empty_cache()
snap = torch.cuda.memory._snapshot()
for seg in snap["segments"]:
    pid = tuple(seg.get("segment_pool_id", ()))
    live = [b for b in seg["blocks"] if b["state"] != "inactive"]
    print("segment pool", pid, "size", seg["total_size"], "live blocks", len(live))
    if pid == pool:
        for b in live:
            print("  LIVE", b["size"], b["state"])
            for f in b.get("frames", [])[:14]:
                print("     ", f["filename"], f["line"], f["name"])
try:
    llm.generate(params=SamplingParams(max_tokens=24, ignore_eos=True), prompt_token_ids=[[1, 2, 3], [4, 5]])
    print(mode, "generate OK")
except Exception as e:  # noqa: BLE001
    print(mode, "generate FAILED:", str(e)[:400])
try:
    torch.rand(3, device="cuda")
    print(mode, "rand OK")
except Exception as e:  # noqa: BLE001
    print(mode, "rand FAILED:", str(e)[:300])
