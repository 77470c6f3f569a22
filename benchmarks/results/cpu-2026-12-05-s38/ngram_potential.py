"""Would prompt lookup (the tokens after the latest earlier occurrence of a request's last 1-3 tokens)
add to the drafter's chain? Reads tree_potential.py's records (/tmp/tree_records.pt: every block's
context length, anchor and base logits, and the final sequences; `static`, a block-7 copy of the
shipped drafter, held-out prompts) and counts per block how many of 3 drafts the drafter's greedy
chain (re-decoded from the kept logits with the Markov head) and a lookup proposal would have had
accepted, overall and by prompt group.

    .venv/bin/python benchmarks/results/cpu-2026-12-05-s38/ngram_potential.py
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

data = torch.load("/tmp/tree_records.pt", weights_only=False)
records, full = data["records"], data["full"]
ROOT = Path(__file__).resolve().parents[3]
d = load_file(str(ROOT / "drafters/SmolLM2-135M-Instruct-dspark/model.safetensors"))
vocab_ids = load_file(str(ROOT / "drafters/SmolLM2-135M-Instruct-dspark/draft_vocab.safetensors"))
vocab_ids = next(iter(vocab_ids.values())).long()[:8192].sort().values
w1 = d[[k for k in d if "markov_w1" in k][0]].float()
w2 = d[[k for k in d if "markov_w2" in k][0]].float()[vocab_ids]


def ngram_proposal(seq, n, min_match, depth):
    """The tokens that followed the latest earlier occurrence of the last min_match..3 tokens."""
    for m in (3, 2, min_match):
        if m < min_match or n < m:
            continue
        key = seq[n - m : n]
        for start in range(n - m - 1, -1, -1):
            if seq[start : start + m] == key:
                return seq[start + m : start + m + depth]
    return []


rows = []
for rid, n, anchor, projected in records:
    seq = full.get(rid)
    depth = projected.shape[0]
    if seq is None or depth < 7 or n + depth > len(seq):
        continue
    truth = seq[n : n + depth]
    prev, chain = anchor, 0
    for k in range(3):
        t = int(vocab_ids[(projected[k] + w2 @ w1[prev]).argmax()])
        if t != truth[k]:
            break
        chain += 1
        prev = t
    # the sequence known at drafting: seq[:n] (n tokens including the anchor)
    out = []
    for min_match in (1, 2, 3):
        prop = ngram_proposal(seq[:n], n, min_match, 3)
        acc = 0
        for a, b in zip(prop, truth, strict=False):
            if a != b:
                break
            acc += 1
        out.append((len(prop) > 0, acc))
    rows.append((chain, out, int(rid.split("-")[1])))
N = len(rows)
chain = sum(r[0] for r in rows) / N
print(f"blocks {N}, chain of 3 accepts {chain:.3f} a block")
for i, m in enumerate((1, 2, 3)):
    found = sum(r[1][i][0] for r in rows) / N
    ng = sum(r[1][i][1] for r in rows) / N
    oracle = sum(max(r[0], r[1][i][1]) for r in rows) / N
    # rule: n-gram replaces the chain when it found a match and ... (upper bound: oracle)
    when_found = [r for r in rows if r[1][i][0]]
    ng_f = sum(r[1][i][1] for r in when_found) / max(len(when_found), 1)
    ch_f = sum(r[0] for r in when_found) / max(len(when_found), 1)
    print(
        f"match >= {m}: found {found:.2f} of blocks; n-gram accepts {ng:.3f} "
        f"(where found {ng_f:.3f} vs chain {ch_f:.3f}); oracle max {oracle:.3f}"
    )

# By prompt group (tree_potential's order: 24 fresh everyday questions, then 8 a domain of
# prompts_eval.jsonl, domains sorted), the rule "the lookup's drafts where an n-gram of 2+ matched,
# else the chain's".
domains = sorted({json.loads(x)["domain"] for x in open(ROOT / "training/prompts_eval.jsonl")})
groups = ["fresh"] * 24 + [d for d in domains for _ in range(8)]
for group in ["fresh", *domains]:
    rs = [r for r in rows if groups[r[2]] == group]
    if not rs:
        continue
    chain_g = sum(r[0] for r in rs) / len(rs)
    rule = sum(r[1][1][1] if r[1][1][0] else r[0] for r in rs) / len(rs)
    found = sum(r[1][1][0] for r in rs) / len(rs)
    print(
        f"{group:8s} {len(rs):5d} blocks: chain {1 + chain_g:.3f} tokens a step, "
        f"lookup where 2+ matched ({found:.2f} of blocks) {1 + rule:.3f}"
    )
