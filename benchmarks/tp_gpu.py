"""Tensor parallelism on GPUs: does TP=2 / TP=4 agree with TP=1, and how fast is a decode step?

A randomly initialised Qwen3-8B-shaped target (hidden 4096, 36 layers, 32 heads, 8 KV heads, head dim
128, intermediate 12288, vocab 151936, q/k norm) is written once as a Hugging Face checkpoint of bf16
weights (each tensor generated from its own seed, so the weights are the same on every run), then
driven through `dspark.runner.model_runner.create_runner` at each TP size, the engine's own runner seam.

bf16 differs from exact arithmetic by itself, so "TP=2 differs from TP=1 bf16" alone cannot tell TP's
error from rounding. First, unless `--no-fp32-reference`, the same bf16 checkpoint runs at TP=1 in
float32 (float64 with `--tiny`, whose plan is float32 already) as an exact reference: its greedy
continuation of the prompts defines the teacher-forced sequences (otherwise TP=1 bf16's does). Then,
for every TP size in the plan's dtype:

- agreement with the reference (`vs_fp32`) and with the first TP size, TP=1 bf16 (`agreement`):
  teacher-forced logits over the sequences (relative error per row, argmax agreement per position) and
  greedy decoding itself (the share of prompts whose whole continuation is identical, and the mean
  length of the identical prefix). A TP size passes (`tp_adds_no_error`) when its logits' relative
  error vs the reference, mean and max, is at most FP32_ERROR_RATIO_LIMIT times that of TP=1 bf16: TP
  then adds no error beyond bf16's own rounding. The old absolute bound vs TP=1 stays as
  `logits_within_tolerance` (LOGITS_REL_TOLERANCE);
- near-ties (`vs_fp32_margins`): a random model's top logits are often nearly tied, so an argmax that
  differs may be a tie broken by rounding. Reported: the median top-1 minus top-2 margin of the
  reference over the teacher-forced rows, and the share of rows whose argmax differs among the rows
  whose reference margin exceeds MARGIN_FACTOR times the mean absolute logit error (not near-ties);
- decode: the time of one target step (broadcast to the ranks included) at several batch sizes, every
  request with `--context` cached tokens, and the tokens/s that gives (not for the reference).

Writes results.json and results.md to --out. `--tiny` runs the same logic on the CPU (gloo) with a tiny
model, which is how CI-less machines check it; the full run takes a few minutes on 4 H200s.

    python3 benchmarks/tp_gpu.py --out /tmp/tp-bench            # nvidia-h200-x4
    python3 benchmarks/tp_gpu.py --out /tmp/tp-bench-tiny --tiny # any machine
"""

from __future__ import annotations

import argparse
import contextlib
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
# SmolLM2-135M's sizes in the Qwen3 layout (its q/k norms added): the embedded default's step shape with
# random weights, for kernel and step timings that need no GGUF.
SMOLLM2 = {
    **QWEN3_8B,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
INIT_STD = 0.02
SHARD_BYTES = 4 << 30
# bf16 keeps 8 bits of mantissa; TP changes the order of every row-parallel sum, over 36 layers.
LOGITS_REL_TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}
# A TP size adds no error of its own when its logits are at most this much further from the exact
# reference than TP=1's in the same dtype (row-parallel sums round in another order, not worse).
FP32_ERROR_RATIO_LIMIT = 1.25
# A reference margin above this many mean absolute logit errors is no near-tie: rounding cannot flip it.
MARGIN_FACTOR = 4.0
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
    # dtype of the exact TP=1 reference run (None: no reference); wider than `dtype`.
    reference_dtype: str | None = None


def full_plan(args: argparse.Namespace) -> Plan:
    return Plan(
        QWEN3_8B, (1, 2, 4), (1, 8, 32, 128), 1024, 3, 10, 8, 32, 32, "cuda", "bfloat16", 16, "float32"
    )


def tiny_plan(args: argparse.Namespace) -> Plan:
    # float32 already, so the reference is float64: the same logic, one step wider.
    return Plan(TINY, (1, 2), (1, 4), 32, 1, 3, 3, 8, 6, "cpu", "float32", 16, "float64")


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
    total = sum(math.prod(shape) * element for shape in tensor_shapes(arch).values())
    # transformers wants the metadata block of the index too.
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
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


def make_runner(checkpoint: Path, tp: int, plan: Plan, num_pages: int, dtype: str | None = None):
    """The engine's runner for `checkpoint` at TP size `tp`, computing in `dtype` (plan.dtype if None)."""
    from dspark.config import DTYPES, EngineConfig
    from dspark.runner.model_runner import create_runner

    dtype = dtype or plan.dtype
    config = EngineConfig(
        model=str(checkpoint),
        spec_mode="off",
        # The config only names the engine's dtypes; the runner computes in the torch dtype passed to
        # it, so a float64 reference names float32 here.
        dtype=dtype if dtype in DTYPES else "float32",
        device=plan.device,
        num_kv_pages=num_pages,
        kv_page_size=plan.page_size,
        tensor_parallel_size=tp,
    )
    return create_runner(config, torch.device(plan.device), getattr(torch, dtype))


@contextlib.contextmanager
def opened_runner(checkpoint: Path, tp: int, plan: Plan, num_pages: int, dtype: str | None = None):
    """Yield (runner, seconds it took to load); the runner is closed and its memory freed after."""
    started = time.perf_counter()
    runner = make_runner(checkpoint, tp, plan, num_pages, dtype)
    loaded_s = time.perf_counter() - started
    try:
        yield runner, loaded_s
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            close()
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def step(tokens: list[list[int]], starts: list[int], pages: list[list[int]], all_logits: bool):
    """One TargetStep over windows `tokens[r]` at positions starts[r].., logits at every row or at the
    last row of each window."""
    from dspark.runner.model_runner import TargetStep

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
    """How far one TP size's results are from a reference run's (TP=1 in the plan dtype, or exact)."""
    rel = (logits - reference).norm(dim=-1) / reference.norm(dim=-1)
    same_prefix = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(greedy_ref, greedy, strict=True)
    ]
    return {
        "logits_rel_error_max": float(rel.max()),
        "logits_rel_error_mean": float(rel.mean()),
        # The old pass criterion: an absolute bound on the max relative error, per plan dtype.
        "logits_abs_tolerance": tolerance,
        "logits_within_tolerance": bool(rel.max() <= tolerance),
        "teacher_forced_argmax_agreement": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
        "greedy_identical_rate": sum(n == len(g) for n, g in zip(same_prefix, greedy_ref, strict=True))
        / len(greedy_ref),
        "greedy_identical_prefix_mean": sum(same_prefix) / len(same_prefix),
    }


def near_ties(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """Whether argmax disagreements with the exact reference are near-ties that rounding breaks."""
    top2 = reference.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    abs_error = float((logits - reference).abs().mean())
    differs = logits.argmax(-1) != reference.argmax(-1)
    clear = margin > MARGIN_FACTOR * abs_error
    return {
        "reference_margin_median": float(margin.double().quantile(0.5)),
        "logits_abs_error_mean": abs_error,
        "rows": len(margin),
        "argmax_differs_rows": int(differs.sum()),
        "clear_rows": int(clear.sum()),
        "clear_argmax_differs_rows": int((differs & clear).sum()),
        # None when every row is a near-tie (nothing to judge)
        "clear_argmax_differs_share": float((differs & clear).sum() / clear.sum()) if clear.any() else None,
    }


def adds_no_error(vs_reference: dict, baseline: dict) -> dict:
    """TP's own error: the ratio of its logits error vs the exact reference to the baseline's (TP=1 in
    the same dtype), and whether both mean and max stay within FP32_ERROR_RATIO_LIMIT."""
    fields = {}
    passes = True
    for stat in ("mean", "max"):
        error = vs_reference[f"logits_rel_error_{stat}"]
        base = baseline[f"logits_rel_error_{stat}"]
        fields[f"fp32_error_ratio_{stat}"] = error / base if base > 0 else None
        passes = passes and error <= FP32_ERROR_RATIO_LIMIT * base
    return fields | {"tp_adds_no_error": passes}


# The run ---------------------------------------------------------------------------------------------


def profile_decode(runner, batch: int, plan: Plan, path: Path) -> None:
    """torch.profiler over a few decode steps in this process (rank 0): where a step's host and device
    time goes, as tables sorted by device and by host time."""
    from torch.profiler import ProfilerActivity, profile

    pages = request_pages(batch, plan.context + 1, plan.page_size)
    tokens = [[1]] * batch
    decode = step(tokens, [plan.context] * batch, pages, all_logits=False)
    runner.run(decode)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.run(decode)
    averages = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"batch {batch}, 5 decode steps\n\n"
        + averages.table(sort_by="self_cuda_time_total", row_limit=25)
        + "\n\n"
        + averages.table(sort_by="cpu_time_total", row_limit=25)
    )


def measure(plan: Plan, checkpoint: Path, profile_dir: Path | None = None) -> tuple[dict, dict | None]:
    """Results per TP size, and the exact reference run's summary (None without one); with
    `profile_dir`, a profile of each TP size's largest decode batch is written there."""
    generator = torch.Generator().manual_seed(1234)
    prompts = torch.randint(
        0, plan.arch["vocab_size"], (plan.num_prompts, plan.prompt_len), generator=generator
    )
    prompts_list = prompts.tolist()
    agreement_pages = (
        len(request_pages(1, plan.prompt_len + plan.new_tokens, plan.page_size)[0]) * plan.num_prompts
    )
    num_pages = max(
        len(request_pages(1, plan.context + 1, plan.page_size)[0]) * max(plan.batch_sizes), agreement_pages
    )
    tolerance = LOGITS_REL_TOLERANCE[plan.dtype]
    exact: dict = {}
    summary = None
    if plan.reference_dtype is not None:
        # TF32 matmuls (off by default) would make a float32 reference hardly more exact than bf16.
        torch.set_float32_matmul_precision("highest")
        # Agreement only, so the KV cache needs no room for the decode batches.
        with opened_runner(checkpoint, 1, plan, agreement_pages, plan.reference_dtype) as (runner, loaded_s):
            greedy = greedy_decode(runner, prompts_list, plan.new_tokens, plan.page_size)
            sequences = [p + g for p, g in zip(prompts_list, greedy, strict=True)]
            # The runner hands logits back in float32 even from a float64 model: that last rounding
            # (2^-24 relative) stays below a float32 model's own error.
            logits = teacher_forced_logits(runner, sequences, plan.page_size)
        exact = {"greedy": greedy, "sequences": sequences, "logits": logits}
        summary = {"dtype": plan.reference_dtype, "tp": 1, "load_s": loaded_s}
        print(f"reference TP=1 {plan.reference_dtype}: loaded in {loaded_s:.1f}s", flush=True)
    results: dict[str, dict] = {}
    # The first TP size's greedy output and logits; its sequences too when there is no exact reference.
    baseline: dict = {"sequences": exact["sequences"]} if exact else {}
    for tp in plan.tp_sizes:
        with opened_runner(checkpoint, tp, plan, num_pages) as (runner, loaded_s):
            greedy = greedy_decode(runner, prompts_list, plan.new_tokens, plan.page_size)
            baseline.setdefault("greedy", greedy)
            baseline.setdefault("sequences", [p + g for p, g in zip(prompts_list, greedy, strict=True)])
            logits = teacher_forced_logits(runner, baseline["sequences"], plan.page_size)
            baseline.setdefault("logits", logits)
            decode = []
            for batch in plan.batch_sizes:
                seconds = decode_step_seconds(runner, batch, plan)
                decode.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": batch / seconds})
            if profile_dir is not None:
                profile_decode(runner, max(plan.batch_sizes), plan, profile_dir / f"tp{tp}.txt")
        result = {
            "load_s": loaded_s,
            "agreement": agreement(baseline["logits"], logits, baseline["greedy"], greedy, tolerance),
            "decode": decode,
        }
        if exact:
            vs_exact = agreement(exact["logits"], logits, exact["greedy"], greedy, tolerance)
            first = results[str(plan.tp_sizes[0])]["vs_fp32"] if results else vs_exact
            result |= {
                "vs_fp32": vs_exact,
                "vs_fp32_margins": near_ties(exact["logits"], logits),
                **adds_no_error(vs_exact, first),
            }
        results[str(tp)] = result
        print(f"TP={tp}: loaded in {loaded_s:.1f}s; {json.dumps(result)}", flush=True)
    return results, summary


def markdown(plan: Plan, report: dict) -> str:
    results = report["results"]
    first = next(iter(results))
    reference = report.get("reference")
    sequences = f"TP=1 {reference['dtype']}" if reference else f"TP={first} {plan.dtype}"
    lines = [
        f"# Tensor parallelism: {report['model']} on {report['device']}",
        "",
        f"dtype {plan.dtype}; {plan.num_prompts} random prompts of {plan.prompt_len} tokens, "
        f"{plan.new_tokens} greedy tokens each (teacher-forced sequences: prompts plus the greedy "
        f"continuation of {sequences}); decode with {plan.context} cached tokens per request.",
        "",
        f"## vs TP={first} {plan.dtype}",
        "",
        "| TP | load s | logits rel. err. max / mean | max within abs. tol. "
        f"{LOGITS_REL_TOLERANCE[plan.dtype]:.0e} | teacher-forced argmax agree | greedy identical "
        "| identical prefix (mean) |",
        "|---:|---:|---:|:---:|---:|---:|---:|",
    ]
    for tp, r in results.items():
        a = r["agreement"]
        cells = [
            tp,
            f"{r['load_s']:.1f}",
            f"{a['logits_rel_error_max']:.2e} / {a['logits_rel_error_mean']:.2e}",
            "yes" if a["logits_within_tolerance"] else "NO",
            *agreement_cells(a, plan),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if reference:
        lines += reference_table(plan, results, reference, first)
    lines += ["", "## Decode", ""]
    lines += ["| batch | " + " | ".join(f"TP={tp} step ms (tok/s)" for tp in results) + " |"]
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


def agreement_cells(a: dict, plan: Plan) -> list[str]:
    """Markdown cells of the argmax and greedy agreement, shared by both agreement tables."""
    return [
        f"{a['teacher_forced_argmax_agreement']:.1%}",
        f"{a['greedy_identical_rate']:.0%}",
        f"{a['greedy_identical_prefix_mean']:.1f} / {plan.new_tokens}",
    ]


def reference_table(plan: Plan, results: dict, reference: dict, first: str) -> list[str]:
    """Markdown lines of the agreement with the exact reference, TP's own error and the near-ties."""
    exact = f"TP=1 {reference['dtype']}"
    lines = [
        "",
        f"## vs {reference['dtype']} reference ({exact}, same checkpoint, "
        f"loaded in {reference['load_s']:.1f}s)",
        "",
        f"TP adds no error: its logits rel. error vs {exact}, max and mean, is at most "
        f"{FP32_ERROR_RATIO_LIMIT}x that of TP={first} {plan.dtype}. Clear rows: the reference's top-1 "
        f"minus top-2 logit margin exceeds {MARGIN_FACTOR:g}x the mean absolute logit error (no near-tie).",
        "",
        "| TP | logits rel. err. max / mean | x TP=" + first + " max / mean | TP adds no error "
        "| teacher-forced argmax agree | greedy identical | identical prefix (mean) | reference margin "
        "(median) | mean abs. logit err. | clear rows | argmax differs in clear rows |",
        "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tp, r in results.items():
        a, m = r["vs_fp32"], r["vs_fp32_margins"]
        ratios = [r[f"fp32_error_ratio_{stat}"] for stat in ("max", "mean")]
        share = m["clear_argmax_differs_share"]
        cells = [
            tp,
            f"{a['logits_rel_error_max']:.2e} / {a['logits_rel_error_mean']:.2e}",
            " / ".join("-" if x is None else f"{x:.2f}" for x in ratios),
            "yes" if r["tp_adds_no_error"] else "NO",
            *agreement_cells(a, plan),
            f"{m['reference_margin_median']:.3g}",
            f"{m['logits_abs_error_mean']:.2e}",
            f"{m['clear_rows']} / {m['rows']}",
            f"{m['clear_argmax_differs_rows']} ({'-' if share is None else f'{share:.1%}'})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def make_dspark_importable() -> None:
    """Without an install (a bare GPU machine), expose backend/dspark as dspark, as the package's own
    mapping does, through a folder of links that spawned ranks see too."""
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
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (checks the logic)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="where the random checkpoint lives")
    parser.add_argument(
        "--tp", type=int, nargs="+", default=None, help="TP sizes (the first is the baseline, normally 1)"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument(
        "--no-fp32-reference",
        dest="fp32_reference",
        action="store_false",
        help="skip the exact TP=1 reference run (float32; float64 with --tiny)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="also write torch.profiler tables (rank 0) to --out"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="compute dtype of every TP size (default bfloat16; float32 shows TP's own arithmetic, "
        "which only reorders sums, without bf16 rounding)",
    )
    args = parser.parse_args(argv)
    for key, value in NCCL_SAFETY.items():
        os.environ.setdefault(key, value)
    make_dspark_importable()
    plan = tiny_plan(args) if args.tiny else full_plan(args)
    overrides = {
        "tp_sizes": tuple(args.tp or plan.tp_sizes),
        "batch_sizes": tuple(args.batch_sizes or plan.batch_sizes),
        "reference_dtype": plan.reference_dtype if args.fp32_reference else None,
        "dtype": args.dtype or plan.dtype,
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
    results, reference = measure(plan, checkpoint, args.out / "profile" if args.profile else None)
    report = {
        "model": "Qwen3-8B-shaped, random weights" if not args.tiny else "tiny Qwen3, random weights",
        "device": torch.cuda.get_device_name(0) if plan.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "plan": asdict(plan),
        "reference": reference,
        "results": results,
        "total_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "results.md").write_text(markdown(plan, report))
    print(markdown(plan, report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
