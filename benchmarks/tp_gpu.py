"""Tensor parallelism on GPUs: does TP=2 / TP=4 agree with TP=1, and how fast is a decode step?

A randomly initialised Qwen3-8B-shaped target (hidden 4096, 36 layers, 32 heads, 8 KV heads, head dim
128, intermediate 12288, vocab 151936, q/k norm) is written once as a Hugging Face checkpoint of bf16
weights (each tensor generated from its own seed, so the weights are the same on every run), then
driven through `dspark.model_runner.create_runner` at each TP size, the engine's own runner seam:

- agreement with TP=1: teacher-forced logits over prompts plus their TP=1 greedy continuation
  (relative error per row, argmax agreement per position) and greedy decoding itself (the share of
  prompts whose whole continuation is identical, and the mean length of the identical prefix);
- decode: the time of one target step (broadcast to the ranks included) at several batch sizes, every
  request with `--context` cached tokens, and the tokens/s that gives.

Writes results.json and results.md to --out. `--tiny` runs the same logic on the CPU (gloo) with a tiny
model, which is how CI-less machines check it; the full run takes a few minutes on 4 H200s.

    python3 benchmarks/tp_gpu.py --out /tmp/tp-bench            # nvidia-h200-x4
    python3 benchmarks/tp_gpu.py --out /tmp/tp-bench-tiny --tiny # any machine
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
TINY = {
    **QWEN3_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}
INIT_STD = 0.02
SHARD_BYTES = 4 << 30
# bf16 keeps 8 bits of mantissa; TP changes the order of every row-parallel sum, over 36 layers.
LOGITS_REL_TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}
# NVLink multicast stays off on shared hosts (the device notes say why); ranks inherit this.
NCCL_SAFETY = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    arch: dict
    tp_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context: int
    warmup_steps: int
    timed_steps: int
    num_prompts: int
    prompt_len: int
    new_tokens: int
    device: str
    dtype: str
    page_size: int = 16


def full_plan(args: argparse.Namespace) -> Plan:
    return Plan(QWEN3_8B, (1, 2, 4), (1, 8, 32, 128), 1024, 3, 10, 8, 32, 32, "cuda", "bfloat16")


def tiny_plan(args: argparse.Namespace) -> Plan:
    return Plan(TINY, (1, 2), (1, 4), 32, 1, 3, 3, 8, 6, "cpu", "float32")


# The checkpoint --------------------------------------------------------------------------------------


def tensor_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3 checkpoint and its shape."""
    h, inter, d = arch["hidden_size"], arch["intermediate_size"], arch["head_dim"]
    heads, kv = arch["num_attention_heads"], arch["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (arch["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes["lm_head.weight"] = (arch["vocab_size"], h)
    return shapes


def write_checkpoint(path: Path, arch: dict, dtype: str, seed: int = 0) -> Path:
    """A random Qwen3 checkpoint at `path`, reused when one with the same recipe is already there.

    Shards are planned from the shapes, then each is generated (on the GPU when there is one) and
    written before the next, so the host never holds more than one shard."""
    from safetensors.torch import save_file

    recipe = {"arch": arch, "dtype": dtype, "seed": seed, "std": INIT_STD}
    marker = path / "dspark-random-recipe.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(arch).items():
        if size >= SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += math.prod(shape) * element
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shape, dtype, seed) for name, shape in shard}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": dtype, **arch}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(json.dumps(recipe))
    return path


def random_tensor(name: str, shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """Norm weights are ones; every matrix is N(0, INIT_STD) from a seed of its own name."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=getattr(torch, dtype))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    tensor = torch.randn(shape, generator=generator, device=device) * INIT_STD
    return tensor.to(getattr(torch, dtype)).cpu()


# Driving the runner ----------------------------------------------------------------------------------


def make_runner(checkpoint: Path, tp: int, plan: Plan, num_pages: int):
    from dspark.config import EngineConfig
    from dspark.model_runner import create_runner

    config = EngineConfig(
        model=str(checkpoint),
        spec_mode="off",
        dtype=plan.dtype,
        device=plan.device,
        num_kv_pages=num_pages,
        kv_page_size=plan.page_size,
        tensor_parallel_size=tp,
    )
    return create_runner(config, torch.device(plan.device), getattr(torch, plan.dtype))


def step(tokens: list[list[int]], starts: list[int], pages: list[list[int]], all_logits: bool):
    """One TargetStep over windows `tokens[r]` at positions starts[r].., logits at every row or at the
    last row of each window."""
    from dspark.model_runner import TargetStep

    lens = [len(t) for t in tokens]
    ends = torch.cumsum(torch.tensor(lens), 0)
    rows = torch.arange(int(ends[-1])) if all_logits else ends - 1
    return TargetStep(
        token_ids=torch.tensor([t for window in tokens for t in window]),
        positions=torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]),
        window_starts=list(starts),
        window_lens=lens,
        pages=pages,
        logit_rows=rows.long(),
        capture_layers=(),
    )


def request_pages(num_requests: int, tokens_each: int, page_size: int) -> list[list[int]]:
    per = math.ceil(tokens_each / page_size)
    return [list(range(r * per, (r + 1) * per)) for r in range(num_requests)]


def greedy_decode(runner, prompts: list[list[int]], new_tokens: int, page_size: int) -> list[list[int]]:
    """Prefill every prompt in one step, then decode them together, greedily."""
    pages = request_pages(len(prompts), len(prompts[0]) + new_tokens, page_size)
    logits = runner.run(step(prompts, [0] * len(prompts), pages, all_logits=False)).logits
    outputs = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(new_tokens - 1):
        starts = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)]
        logits = runner.run(step([[o[-1]] for o in outputs], starts, pages, all_logits=False)).logits
        for out, token in zip(outputs, logits.argmax(-1).tolist(), strict=True):
            out.append(token)
    return outputs


def teacher_forced_logits(runner, sequences: list[list[int]], page_size: int) -> torch.Tensor:
    """Logits [sum of lengths, vocab] of every position of every sequence, one prefill step."""
    pages = request_pages(len(sequences), len(sequences[0]), page_size)
    return runner.run(step(sequences, [0] * len(sequences), pages, all_logits=True)).logits


def decode_step_seconds(runner, batch: int, plan: Plan) -> float:
    """Mean wall time of one decode step: `batch` requests, each with plan.context cached tokens."""
    pages = request_pages(batch, plan.context + 1, plan.page_size)
    generator = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, plan.arch["vocab_size"], (batch, 1), generator=generator).tolist()
    decode = step(tokens, [plan.context] * batch, pages, all_logits=False)
    for _ in range(plan.warmup_steps):
        runner.run(decode)
    started = time.perf_counter()
    for _ in range(plan.timed_steps):
        runner.run(decode)  # returns logits on the host: the step is complete
    return (time.perf_counter() - started) / plan.timed_steps


def agreement(
    reference: torch.Tensor,
    logits: torch.Tensor,
    greedy_ref: list[list[int]],
    greedy: list[list[int]],
    tolerance: float,
) -> dict:
    """How far one TP size's results are from TP=1's."""
    rel = (logits - reference).norm(dim=-1) / reference.norm(dim=-1)
    same_prefix = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(greedy_ref, greedy, strict=True)
    ]
    return {
        "logits_rel_error_max": float(rel.max()),
        "logits_rel_error_mean": float(rel.mean()),
        "logits_within_tolerance": bool(rel.max() <= tolerance),
        "teacher_forced_argmax_agreement": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
        "greedy_identical_rate": sum(n == len(g) for n, g in zip(same_prefix, greedy_ref, strict=True))
        / len(greedy_ref),
        "greedy_identical_prefix_mean": sum(same_prefix) / len(same_prefix),
    }


# The run ---------------------------------------------------------------------------------------------


def measure(plan: Plan, checkpoint: Path) -> dict:
    generator = torch.Generator().manual_seed(1234)
    prompts = torch.randint(
        0, plan.arch["vocab_size"], (plan.num_prompts, plan.prompt_len), generator=generator
    )
    prompts_list = prompts.tolist()
    num_pages = max(
        len(request_pages(1, plan.context + 1, plan.page_size)[0]) * max(plan.batch_sizes),
        len(request_pages(1, plan.prompt_len + plan.new_tokens, plan.page_size)[0]) * plan.num_prompts,
    )
    tolerance = LOGITS_REL_TOLERANCE[plan.dtype]
    results: dict[str, dict] = {}
    reference: dict = {}
    for tp in plan.tp_sizes:
        started = time.perf_counter()
        runner = make_runner(checkpoint, tp, plan, num_pages)
        loaded_s = time.perf_counter() - started
        try:
            greedy = greedy_decode(runner, prompts_list, plan.new_tokens, plan.page_size)
            if not reference:
                sequences = [p + g for p, g in zip(prompts_list, greedy, strict=True)]
                reference = {"greedy": greedy, "sequences": sequences}
            logits = teacher_forced_logits(runner, reference["sequences"], plan.page_size)
            reference.setdefault("logits", logits)
            decode = []
            for batch in plan.batch_sizes:
                seconds = decode_step_seconds(runner, batch, plan)
                decode.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": batch / seconds})
        finally:
            close = getattr(runner, "close", None)
            if close is not None:
                close()
            del runner
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        results[str(tp)] = {
            "load_s": loaded_s,
            "agreement": agreement(reference["logits"], logits, reference["greedy"], greedy, tolerance),
            "decode": decode,
        }
        print(f"TP={tp}: loaded in {loaded_s:.1f}s; {json.dumps(results[str(tp)])}", flush=True)
    return results


def markdown(plan: Plan, report: dict) -> str:
    results = report["results"]
    lines = [
        f"# Tensor parallelism: {report['model']} on {report['device']}",
        "",
        f"dtype {plan.dtype}; {plan.num_prompts} random prompts of {plan.prompt_len} tokens, "
        f"{plan.new_tokens} greedy tokens each; decode with {plan.context} cached tokens per request.",
        "",
        "| TP | load s | logits rel. err. max / mean | within tolerance | teacher-forced argmax agree "
        "| greedy identical | identical prefix (mean) |",
        "|---:|---:|---:|:---:|---:|---:|---:|",
    ]
    for tp, r in results.items():
        a = r["agreement"]
        cells = [
            tp,
            f"{r['load_s']:.1f}",
            f"{a['logits_rel_error_max']:.2e} / {a['logits_rel_error_mean']:.2e}",
            "yes" if a["logits_within_tolerance"] else "NO",
            f"{a['teacher_forced_argmax_agreement']:.1%}",
            f"{a['greedy_identical_rate']:.0%}",
            f"{a['greedy_identical_prefix_mean']:.1f} / {plan.new_tokens}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| batch | " + " | ".join(f"TP={tp} step ms (tok/s)" for tp in results) + " |"]
    lines.append("|---:|" + "---:|" * len(results))
    base = {d["batch"]: d["step_ms"] for d in next(iter(results.values()))["decode"]}
    for i, batch in enumerate(plan.batch_sizes):
        cells = []
        for r in results.values():
            d = r["decode"][i]
            cells.append(f"{d['step_ms']:.2f} ({d['tokens_per_s']:.0f}, x{base[batch] / d['step_ms']:.2f})")
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    lines += ["", "x: speed-up of the step over the first TP size."]
    return "\n".join(lines) + "\n"


def make_dspark_importable() -> None:
    """Without an install (a bare GPU machine), expose backend/dspark with kernels/ as dspark.kernels,
    as the package's own mapping does, through a folder of links that spawned ranks see too."""
    try:
        import dspark.kernels  # noqa: F401

        return
    except ImportError:
        pass
    root = Path(tempfile.mkdtemp(prefix="dspark-path-"))
    package = root / "dspark"
    package.mkdir()
    for entry in (REPO / "backend" / "dspark").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "kernels").symlink_to(REPO / "kernels")
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (checks the logic)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="where the random checkpoint lives")
    parser.add_argument("--tp", type=int, nargs="+", default=None, help="TP sizes (first is the reference)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    for key, value in NCCL_SAFETY.items():
        os.environ.setdefault(key, value)
    make_dspark_importable()
    plan = tiny_plan(args) if args.tiny else full_plan(args)
    overrides = {
        "tp_sizes": tuple(args.tp or plan.tp_sizes),
        "batch_sizes": tuple(args.batch_sizes or plan.batch_sizes),
    }
    plan = Plan(**(asdict(plan) | overrides))
    if plan.device == "cuda" and torch.cuda.device_count() < max(plan.tp_sizes):
        parser.error(
            f"TP sizes {plan.tp_sizes} need {max(plan.tp_sizes)} GPUs; {torch.cuda.device_count()} visible"
        )
    default_dir = Path(tempfile.gettempdir()) / (
        "dspark-qwen3-tiny-random" if args.tiny else "dspark-qwen3-8b-random"
    )
    started = time.perf_counter()
    checkpoint = write_checkpoint(
        args.checkpoint or default_dir, plan.arch, "bfloat16" if not args.tiny else "float32"
    )
    print(f"checkpoint {checkpoint} ready in {time.perf_counter() - started:.1f}s", flush=True)
    report = {
        "model": "Qwen3-8B-shaped, random weights" if not args.tiny else "tiny Qwen3, random weights",
        "device": torch.cuda.get_device_name(0) if plan.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "plan": asdict(plan),
        "results": measure(plan, checkpoint),
        "total_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "results.md").write_text(markdown(plan, report))
    print(markdown(plan, report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
