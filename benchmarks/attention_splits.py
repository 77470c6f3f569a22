"""Paged attention's key-range splits at decode shapes: every split count side by side, and the one
`choose_num_splits` picks.

On one H200 (about half a minute):
    python3 benchmarks/attention_splits.py --out $OUT/attention-splits
On a CPU, the same logic at toy sizes under Triton's interpreter (numbers meaningless):
    python benchmarks/attention_splits.py --tiny --out /tmp/attention-splits

Why: in the Qwen3-8B-shaped decode step at batch 1 over 1024 cached tokens (RESULTS.md, session 27)
attention took ~7 µs a layer plus ~2 µs of its split-combine kernel, against ~1 µs to read the layer's
keys and values; `choose_num_splits` gave 16 splits of 64 keys there. For each (batch, window, context)
this times `paged_attention` (with its combine) at each split count over enough distinct layers' caches
that L2 never holds one, replayed from one CUDA graph a split count (no launch gaps but the kernels'
own), and reports µs a layer, the KV bytes a layer over that time against the copy bandwidth, and each
result's error against one split. Writes results.json and results.md into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
sys.path.insert(0, str(ROOT / "tests"))  # the parity cases (test support)

# Qwen3-8B's attention: q heads, kv heads, head dim; the engine's page size.
SHAPE = (32, 8, 128, 16)
TINY_SHAPE = (4, 2, 16, 4)


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """(batch, window, context) triples from "1x1x1024,8x1x1024" (a missing window is 1)."""
    configs = []
    for item in text.split(","):
        parts = [int(p) for p in item.strip().split("x")]
        batch, window, context = parts if len(parts) == 3 else (parts[0], 1, parts[1])
        configs.append((batch, window, context))
    return configs


def time_layers(run_layer, layers: int, replays: int) -> float:
    """Seconds a layer: run_layer(i) for every layer i, captured in one CUDA graph, replayed."""
    for i in range(min(layers, 2)):
        run_layer(i)  # compile and autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            run_layer(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * layers)


def measure(
    kernels,
    parity,
    reference,
    config: tuple[int, int, int],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    split_counts: list[int],
    bandwidth: float | None,
    replays: int,
) -> dict:
    """One (batch, window, context): each split count's error against one split and, on a GPU, its µs a
    layer over enough distinct layers' caches to miss L2."""
    batch, window, context = config
    q_heads, kv_heads, head_dim, page_size = shape
    kv_bytes = 2 * batch * (context + window) * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    timed = device.type == "cuda"
    layers = max(1, min(36, math.ceil((256 << 20) / kv_bytes))) if timed else 1
    cases = [
        parity.make_attention_case(
            [window] * batch,
            [context] * batch,
            q_heads,
            kv_heads,
            head_dim,
            page_size,
            True,
            dtype,
            device,
            gen,
        )
        for _ in range(layers)
    ]
    outs = [torch.empty_like(c.q) for c in cases]
    chosen = kernels.attention.choose_num_splits(batch * window, batch, kv_heads, device)
    row: dict = {"batch": batch, "window": window, "context": context, "layers": layers, "chosen": chosen}
    one = kernels.attention.paged_attention(*cases[0].args(), num_splits=1)
    err = parity.rel_err(one, reference.paged_attention(*cases[0].args()))
    assert err <= parity.tolerance(dtype), f"one split against the reference: {err:.2e}"
    row["splits"] = {}
    for splits in sorted({*split_counts, chosen}):
        got = kernels.attention.paged_attention(*cases[0].args(), num_splits=splits)
        entry = {"rel_err_vs_one_split": parity.rel_err(got, one)}
        assert entry["rel_err_vs_one_split"] <= parity.tolerance(dtype), (splits, entry)
        if timed:

            def run_layer(i: int, s: int = splits) -> None:
                kernels.attention.paged_attention(*cases[i].args(), num_splits=s, out=outs[i])

            seconds = time_layers(run_layer, layers, replays)
            entry["us_per_layer"] = 1e6 * seconds
            entry["of_copy_bw"] = kv_bytes / seconds / bandwidth
        row["splits"][str(splits)] = entry
    if timed:
        best = min(row["splits"], key=lambda s: row["splits"][s]["us_per_layer"])
        row["best"] = int(best)
        row["chosen_over_best"] = (
            row["splits"][str(chosen)]["us_per_layer"] / row["splits"][best]["us_per_layer"]
        )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="toy sizes in Triton's interpreter (CPU)")
    parser.add_argument("--configs", default="1x1x256,1x1x1024,1x4x1024,1x1x4096,8x1x1024,8x1x4096,64x1x1024")
    parser.add_argument("--splits", default="1,2,4,8,16,32")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args(argv)

    import kernel_parity as parity

    from dspark.kernels import reference
    from dspark.kernels.runtime import load_kernels

    kernels = load_kernels(interpret=args.tiny)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    q_heads, kv_heads, head_dim, page_size = TINY_SHAPE if args.tiny else SHAPE
    configs = parse_configs("1x1x40,2x3x24" if args.tiny else args.configs)
    split_counts = [int(s) for s in ("1,2,4" if args.tiny else args.splits).split(",")]
    bandwidth = None
    if not args.tiny:
        from gemv import copy_bandwidth

        bandwidth = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(0)
    results: dict = {"copy_bandwidth_GBps": bandwidth and bandwidth / 1e9, "rows": []}
    for batch, window, context in configs:
        row = measure(
            kernels,
            parity,
            reference,
            (batch, window, context),
            (q_heads, kv_heads, head_dim, page_size),
            dtype,
            device,
            gen,
            split_counts,
            bandwidth,
            args.replays,
        )
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    name = "Toy" if args.tiny else "Qwen3-8B"
    lines = [
        f"{name} attention ({q_heads} q heads, {kv_heads} kv heads, head dim {head_dim}), {dtype}; µs a "
        f"layer (a CUDA graph over distinct layers' caches); copy bandwidth "
        f"{results['copy_bandwidth_GBps'] or 0:.0f} GB/s",
        "",
        "| batch | window | context | chosen splits | "
        + " | ".join(f"{s} splits" for s in split_counts)
        + " | best | chosen / best |",
        "|---:|---:|---:|---:|" + "---:|" * len(split_counts) + "---:|---:|",
    ]
    for row in results["rows"]:
        cells = []
        for s in split_counts:
            entry = row["splits"].get(str(s), {})
            us = entry.get("us_per_layer")
            cells.append("-" if us is None else f"{us:.2f} ({entry['of_copy_bw']:.2f})")
        lines.append(
            f"| {row['batch']} | {row['window']} | {row['context']} | {row['chosen']} | "
            + " | ".join(cells)
            + f" | {row.get('best', '-')} | {row.get('chosen_over_best', float('nan')):.2f} |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
