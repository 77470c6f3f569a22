"""How much would a draft tree commit over the shipped drafter's chain? SmolLM2 fp32 on this CPU,
`static` with a block-7 copy of the shipped drafter, greedy, held-out prompts (the 24 fresh everyday
questions and 8 a domain of training/prompts_eval.jsonl); every block's base logits are kept, and
afterwards each position's rank of the target's true token (given a correct path, with its Markov
correction) and the tokens a step of a few tree shapes are counted from them.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s38/tree_potential.py
"""

import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks")]
from e2e import bench_config  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.spec.proposer import DSparkProposer  # noqa: E402
from dspark.training.data import encode_prompt  # noqa: E402

block7 = Path(tempfile.mkdtemp()) / "drafter7"
shutil.copytree(ROOT / "drafters/SmolLM2-135M-Instruct-dspark", block7)
config = json.loads((block7 / "config.json").read_text())
config["block_size"] = 7
config["confidence_temperatures"] += [1.0] * (7 - len(config["confidence_temperatures"]))
(block7 / "config.json").write_text(json.dumps(config))

prompts = [
    json.loads(x)["prompt"]
    for x in open(ROOT / "benchmarks/results/cpu-2026-12-04-s33/fresh_everyday_24.jsonl")
]
by_domain = collections.defaultdict(list)
for line in open(ROOT / "training/prompts_eval.jsonl"):
    p = json.loads(line)
    by_domain[p["domain"]].append(p["prompt"])
for d in sorted(by_domain):
    prompts += by_domain[d][:8]

records = []
current: dict = {}
orig_propose = DSparkProposer.propose
orig_decode = DSparkProposer._markov_decode


def propose(self, seqs, length=None):
    current["seqs"] = [(s.request_id, len(s.token_ids)) for s in seqs]
    return orig_propose(self, seqs, length)


def decode(self, heads, anchors, choose=None, length=None):
    out = orig_decode(self, heads, anchors, choose, length)
    for r, (rid, n) in enumerate(current["seqs"]):
        records.append((rid, n, int(anchors[r]), heads.projected[r].float().clone()))
    return out


DSparkProposer.propose = propose
DSparkProposer._markov_decode = decode
llm = LLM(bench_config("", str(block7), "cpu", 8, spec_mode="static", adaptive_speculation=False))
proposer = llm.engine.load().proposer if hasattr(llm.engine.load(), "proposer") else None
params = SamplingParams(max_tokens=96)
full = {}
for i in range(0, len(prompts), 8):
    ids = [encode_prompt(llm.tokenizer, p) for p in prompts[i : i + 8]]
    outs = llm.generate(params=params, prompt_token_ids=ids)
    for o, pid in zip(outs, ids, strict=True):
        full[o.request_id] = pid + list(o.token_ids)
    print(f"{i + 8} prompts, {len(records)} blocks", flush=True)

torch.save({"records": records, "full": full}, "/tmp/tree_records.pt")
# The proposer that drafted: find it through a recorded call's self (the patched method saw it).
prop = None
for obj in __import__("gc").get_objects():
    if isinstance(obj, DSparkProposer):
        prop = obj
assert prop is not None
vocab_ids = prop.vocab_ids
w1 = prop.drafter.markov_w1.weight.float()
w2 = prop.draft_w2.float()
index_of = torch.full((w1.shape[0],), -1, dtype=torch.long)
index_of[vocab_ids] = torch.arange(vocab_ids.shape[0])

# ranks[k]: the rank of the true token at depth k (0-based; 99 = not in the top 64 or not in the
# draft vocabulary), given the true tokens before it; chain: the shipped greedy chain's accepted count.
ranks, truths_in, chain = [], [], []
for rid, n, anchor, projected in records:
    seq = full.get(rid)
    depth = projected.shape[0]
    if seq is None or depth < 7 or n + depth > len(seq):
        continue
    truth = seq[n : n + depth]
    prev, row = anchor, []
    for k in range(depth):
        logits = projected[k] + w2 @ w1[prev]
        top = logits.topk(64).indices
        j = index_of[truth[k]]
        hit = (top == j).nonzero()
        row.append(int(hit[0, 0]) if len(hit) else 99)
        prev = truth[k]
    # greedy chain
    prev, acc = anchor, 0
    for k in range(depth):
        logits = projected[k] + w2 @ w1[prev]
        t = int(vocab_ids[logits.argmax()])
        if t != truth[k]:
            break
        acc += 1
        prev = t
    ranks.append(row)
    chain.append(acc)

ranks_t = torch.tensor(ranks)
print(f"blocks {len(ranks)}")
for k in range(ranks_t.shape[1]):
    r = ranks_t[:, k]
    given = (ranks_t[:, :k] == 0).all(dim=1) if k else torch.ones_like(r, dtype=torch.bool)
    dist = [float((r[given] < c).float().mean()) for c in (1, 2, 3, 4, 8)]
    print(f"depth {k + 1}: top-1/2/3/4/8 given a correct path {' '.join(f'{x:.3f}' for x in dist)}")


def accepted(widths):
    """Accepted count of a tree that keeps the top widths[k] children at every node of depth k."""
    ok = torch.ones(len(ranks), dtype=torch.bool)
    total = torch.zeros(len(ranks))
    for k, w in enumerate(widths):
        ok = ok & (ranks_t[:, k] < w)
        total += ok.float()
    return float(total.mean())


def nodes(widths):
    n, level = 0, 1
    for w in widths:
        level *= w
        n += level
    return n


print(f"chain (shipped argmax) accepted a block: 7 deep {sum(chain) / len(chain):.3f}")
for widths in (
    [1],
    [1, 1],
    [1, 1, 1],
    [1] * 7,
    [2],
    [3],
    [4],
    [2, 1],
    [3, 1],
    [2, 1, 1],
    [3, 1, 1],
    [4, 1, 1],
    [2, 2, 1],
    [3, 2, 1],
    [2, 2, 2],
    [4, 2, 1],
    [3, 1, 1, 1],
    [4, 1, 1, 1, 1],
    [8, 1, 1],
    [8, 2, 1],
):
    print(f"tree {widths}: {nodes(widths)} nodes, tokens a step {1 + accepted(widths):.3f}")
