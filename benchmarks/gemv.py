"""The skinny-product kernel (`dspark.kernels.gemv`) against F.linear (cuBLAS) at decode-step row counts.

On one H200 (about a minute):
    python3 benchmarks/gemv.py --out $OUT/gemv
On a CPU, the same logic at toy sizes under Triton's interpreter (numbers meaningless):
    python benchmarks/gemv.py --tiny --out /tmp/gemv

Each projection of the Qwen3-8B and SmolLM2 shapes, at 1, 2, 4 and 8 rows, bf16: every kernel tile of
a small sweep and F.linear, side by side in one run. A decode step reads each layer's weight once, from
memory, so the timing cycles through enough distinct copies of the weight (>= 1 GiB) that L2 never
holds one, inside one CUDA-graph replay (no launch gaps). Reports microseconds a product, the weight's
GB/s against the copy bandwidth measured at the start, and the best tile's ratio to F.linear; checks
each result against F.linear. Writes results.json and results.md into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))

SHAPES = {  # name: (n, k) of the weight [n, k]
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (24576, 4096),
    "8B down": (4096, 12288),
    "SmolLM2 qkv": (960, 576),
    "SmolLM2 o": (576, 576),
    "SmolLM2 gate_up": (3072, 576),
    "SmolLM2 down": (576, 1536),
}
TINY_SHAPES = {"tiny a": (48, 40), "tiny b": (17, 100)}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write), best of 5."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = math.inf
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * a.numel() / best


def time_graph(fn, weights: list[torch.Tensor], x: torch.Tensor, replays: int) -> float:
    """Seconds a product, fn(x, w) over every weight once per replay of one CUDA graph."""
    for w in weights[:2]:
        fn(x, w)  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for w in weights:
                fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * len(weights))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="toy sizes in Triton's interpreter (CPU)")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()

    from dspark.kernels.runtime import load_kernels

    kernels = load_kernels(interpret=args.tiny)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shapes = TINY_SHAPES if args.tiny else SHAPES
    rows_list = [int(r) for r in args.rows.split(",")]
    configs = [kernels.gemv.GemvConfig()]
    if not args.tiny:  # a sweep that holds every tile `tile_for` picks
        configs = [
            kernels.gemv.GemvConfig(block_n=bn, block_k=bk, num_stages=st, num_warps=nw)
            for bn in (16, 32, 64)
            for bk in (128, 256, 512)
            for st in (3, 4, 6)
            for nw in (4, 8)
            if bn * bk <= 16384
        ]
    bandwidth = None if args.tiny else copy_bandwidth(device)
    results = {"copy_bandwidth_GBps": bandwidth and bandwidth / 1e9, "rows": []}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, (n, k) in shapes.items():
        bytes_per_weight = n * k * torch.finfo(dtype).bits // 8
        copies = 1 if args.tiny else max(2, min(64, math.ceil((1 << 30) / bytes_per_weight)))
        weights = [
            (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(device=device, dtype=dtype)
            for _ in range(copies)
        ]
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
            ref = F.linear(x.float(), weights[0].float())
            row = {"shape": name, "n": n, "k": k, "rows": rows}
            err = 0.0
            runnable = []
            for config in configs:
                try:
                    got = kernels.gemv.gemv(x, weights[0], config).float()
                except Exception as error:  # a tile too large for the device's shared memory
                    print(f"skipped {config}: {type(error).__name__}", flush=True)
                    continue
                runnable.append(config)
                err = max(err, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
            row["max_rel_err"] = err
            if not args.tiny:
                row["linear_us"] = 1e6 * time_graph(lambda a, w: F.linear(a, w), weights, x, args.replays)
                timed = []
                for config in runnable:
                    seconds = time_graph(
                        lambda a, w, c=config: kernels.gemv.gemv(a, w, c), weights, x, args.replays
                    )
                    timed.append((seconds, config))
                seconds, best = min(timed, key=lambda t: t[0])
                row["gemv_us"] = 1e6 * seconds
                row["best_config"] = vars(best)
                chosen = kernels.gemv.tile_for(n, k)
                row["chosen_tile_us"] = 1e6 * next((s for s, c in timed if c == chosen), math.nan)
                row["linear_of_copy_bw"] = bytes_per_weight / (row["linear_us"] / 1e6) / bandwidth
                row["gemv_of_copy_bw"] = bytes_per_weight / seconds / bandwidth
                row["linear_over_gemv"] = row["linear_us"] / row["gemv_us"]
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"copy bandwidth {results['copy_bandwidth_GBps'] or 0:.0f} GB/s; bf16; microseconds a product "
        "(CUDA graph, weights cycled past L2)",
        "",
        "| weight | rows | F.linear us | of copy bw | gemv us (best tile) | of copy bw | F.linear / gemv "
        "| best tile | gemv us (`tile_for`'s tile) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in results["rows"]:
        if "gemv_us" not in row:
            continue
        tile = row["best_config"]
        lines.append(
            f"| {row['shape']} [{row['n']}x{row['k']}] | {row['rows']} | {row['linear_us']:.2f} | "
            f"{row['linear_of_copy_bw']:.2f} | {row['gemv_us']:.2f} | {row['gemv_of_copy_bw']:.2f} | "
            f"{row['linear_over_gemv']:.2f} | {tile['block_n']}x{tile['block_k']} s{tile['num_stages']} "
            f"w{tile['num_warps']} | {row['chosen_tile_us']:.2f} |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
