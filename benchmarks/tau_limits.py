"""Where a drafter's drafts miss, against how sure the target itself was (issue 19: what limits tau).

Teacher-forced over held-out records (the target's own answers, as `dspark distill-data` writes them):
at every block position of random anchors, the drafter's draft hits when its argmax equals the target's
(the greedy acceptance rule). Positions are binned by the target's own top-1 probability there; per bin
the table gives the share of positions, the drafter's hit rate at the block's first position and at
every position, and the hit rate if its top 2 / top 4 were verified (what a small tree of drafts could
reach). Then the survival per position and tau (1 + the sum of survivals) per domain, and what tau would
be if the drafter hit every position where the target's top-1 probability is at least 0.5 / 0.9 and
missed where it does today elsewhere (the share of tau's shortfall each group of positions holds).

    .venv/bin/dspark distill-data --device cpu --dtype float32 --prompts training/prompts_eval.jsonl \\
        --out-dir /tmp/heldout --num-prompts 128 --val-prompts 128 --max-new-tokens 128 \\
        --sample-fraction 0 --batch-size 64 --max-minutes 15 --seed 5
    .venv/bin/python benchmarks/tau_limits.py --data /tmp/heldout --both-sides \\
        --draft drafters/SmolLM2-135M-Instruct-dspark

(Every answer there is to an evaluation prompt, which no drafter trains on: `--both-sides` scores the
ones distill-data filed on its training side too.)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# training/variants.sh runs this where the project is not installed (as training/run_dspark.py does).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

if TYPE_CHECKING:
    from dspark.runner.models.llama import CausalLM
    from dspark.spec.drafter import Drafter
    from dspark.training.records import DistillRecord

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0001)  # the target's top-1 probability


def collect(
    target: CausalLM,
    drafter: Drafter,
    records: list[DistillRecord],
    anchors: int,
    batch_size: int,
    max_length: int,
    seed: int,
    vocab: torch.Tensor | None = None,
) -> dict:
    """Per whole block [N, block_size] (blocks running past an answer's end are left out): the target's
    top-1 probability and the drafter's hit in its top 1, 2 and 4 (drafting from `vocab`'s tokens, the
    draft vocabulary's sorted ids; None: every token)."""
    from dspark.training.calibration import teacher_forced_blocks
    from dspark.training.data import AnchorSampler

    block_size, device = drafter.config.block_size, drafter.fc.weight.device
    sampler = AnchorSampler(records, batch_size, anchors, max_length, seed, min_following=block_size)
    columns: dict[str, list[torch.Tensor]] = defaultdict(list)
    with torch.no_grad():
        for _, batch in sampler.one_pass():
            targets, _, _, logits = teacher_forced_blocks(target, drafter, batch.to(device), vocab)
            probs = torch.softmax(targets.target_logits.float(), -1)
            top_p, top_id = probs.max(-1)
            ranked = logits.topk(4, dim=-1).indices
            hit = ranked == top_id[..., None]
            keep = targets.valid.all(dim=-1)  # whole blocks only: survival is a product along the block
            columns["top_p"].append(top_p[keep].cpu())
            columns["hit1"].append(hit[..., :1].any(-1)[keep].cpu())
            columns["hit2"].append(hit[..., :2].any(-1)[keep].cpu())
            columns["hit4"].append(hit.any(-1)[keep].cpu())
    return {name: torch.cat(parts) for name, parts in columns.items()}  # [N, block_size]


def summarize(data: dict, block_size: int) -> dict:
    """The tables' numbers (see the module's docstring)."""
    top_p, hit1, hit2, hit4 = data["top_p"], data["hit1"], data["hit2"], data["hit4"]
    rows = []
    for low, high in zip(BINS, BINS[1:], strict=False):
        inside = (top_p >= low) & (top_p < high)
        count = int(inside.sum())
        first = inside[:, 0]
        rows.append(
            {
                "target_top1": f"{low:.2f}-{min(high, 1.0):.2f}",
                "share": round(count / top_p.numel(), 3),
                "share_first": round(int(first.sum()) / top_p.shape[0], 3),
                "hit_first": round(float(hit1[:, 0][first].float().mean()), 3) if int(first.sum()) else None,
                "hit_all": round(float(hit1[inside].float().mean()), 3) if count else None,
                "hit_top2": round(float(hit2[inside].float().mean()), 3) if count else None,
                "hit_top4": round(float(hit4[inside].float().mean()), 3) if count else None,
            }
        )

    def tau(hits: torch.Tensor) -> float:
        return round(1.0 + float(hits.float().cumprod(dim=-1).mean(0).sum()), 3)

    per_domain = {}
    domains = data["domain"]
    for domain in sorted(set(domains)) + ["all"]:
        rows_of = torch.tensor([domain == "all" or d == domain for d in domains])
        hits = hit1[rows_of]
        per_domain[domain] = {
            "blocks": int(rows_of.sum()),
            "survival": [round(float(s), 3) for s in hits.float().cumprod(dim=-1).mean(0)],
            "tau": tau(hits),
            "tau_top2_first": tau(torch.cat([hit2[rows_of][:, :1], hits[:, 1:]], dim=1)),
            "tau_if_hit_where_target_ge_0.5": tau(hits | (top_p[rows_of] >= 0.5)),
            "tau_if_hit_where_target_ge_0.9": tau(hits | (top_p[rows_of] >= 0.9)),
            "tau_if_hit_where_target_lt_0.5": tau(hits | (top_p[rows_of] < 0.5)),
        }
    return {"block_size": block_size, "bins": rows, "domains": per_domain}


def markdown(summary: dict) -> str:
    """The two tables."""
    lines = [
        "| target top-1 p | share of positions | share of first positions | hit, first position | hit, all"
        " positions | hit in top 2 | hit in top 4 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary["bins"]:
        lines.append(
            f"| {row['target_top1']} | {row['share']} | {row['share_first']} | {row['hit_first']} | "
            f"{row['hit_all']} | {row['hit_top2']} | {row['hit_top4']} |"
        )
    lines += [
        "",
        "| domain | blocks | survival per position | tau | tau, top 2 at the first position | tau if hit"
        " where target p >= 0.5 | >= 0.9 | where p < 0.5 |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for domain, row in summary["domains"].items():
        lines.append(
            f"| {domain} | {row['blocks']} | {', '.join(map(str, row['survival']))} | {row['tau']} | "
            f"{row['tau_top2_first']} | {row['tau_if_hit_where_target_ge_0.5']} | "
            f"{row['tau_if_hit_where_target_ge_0.9']} | {row['tau_if_hit_where_target_lt_0.5']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", nargs="+", required=True, help="held-out records (shards or folders)")
    parser.add_argument("--draft", required=True, help="drafter directory")
    parser.add_argument("--target", default=None, help="target model directory (default: the project's)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--block-size", type=int, default=0, help="score blocks of this size (0: the drafter's)"
    )
    parser.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--both-sides",
        action="store_true",
        help="score the records' training side too (records written from prompts no drafter trained on)",
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=0,
        help="draft from this many tokens, as the engine's draft_vocab_size (0: the drafter's own, -1: all)",
    )
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()

    from dspark.config import DEFAULT_TARGET_DIR
    from dspark.runner.models.loader import load_target_model, resolve_device
    from dspark.spec.draft_checkpoint import load_drafter
    from dspark.spec.draft_vocab import load_draft_vocab
    from dspark.training.shards import read_data

    device = resolve_device(args.device)  # fp32 on either: the hits compare argmaxes
    target = load_target_model(args.target or str(DEFAULT_TARGET_DIR), dtype=torch.float32, device=device)
    target.requires_grad_(False)
    drafter = load_drafter(args.draft, torch.float32, device)
    if args.block_size:
        drafter.config.block_size = args.block_size
    vocab = load_draft_vocab(args.draft, args.draft_vocab_size, target.config.vocab_size)
    read = read_data(args.data, jsonl_side="held_out")
    records = read.held_out + (read.train if args.both_sides else [])
    by_domain = defaultdict(list)
    for record in records:
        by_domain[record.domain].append(record)
    parts = {
        domain: collect(
            target, drafter, group, args.anchors, args.batch_size, args.max_length, args.seed, vocab
        )
        for domain, group in sorted(by_domain.items())
    }
    data = {
        name: torch.cat([part[name] for part in parts.values()]) for name in ("top_p", "hit1", "hit2", "hit4")
    }
    data["domain"] = [domain for domain, part in parts.items() for _ in range(part["top_p"].shape[0])]
    summary = summarize(data, drafter.config.block_size)
    print(markdown(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
