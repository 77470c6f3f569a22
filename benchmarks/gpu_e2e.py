"""The GPU engine on one H200: one target step against its bandwidth floor, and end-to-end decoding side
by side (dspark off / static / compact and Hugging Face transformers `generate()`).

    python3 benchmarks/gpu_e2e.py --out $OUT/e2e --parts step,e2e8b    # Qwen3-8B shape, random bf16
    python3 benchmarks/gpu_e2e.py --out $OUT/e2e --parts smollm2       # the embedded default + drafter
    python3 benchmarks/gpu_e2e.py --out $OUT/prof --parts profile --trace --budget-s 400
    python3 benchmarks/gpu_e2e.py --out /tmp/prof --parts profile --device cpu --shape tiny --context 32

Parts:
- `step`: one target forward of `batch` windows of `window` tokens (1 = decode, 2..8 = verify), each
  request with --context cached tokens, replayed from a CUDA graph and run eagerly; its floor is the
  bytes it must read (weights + the KV cache it attends to) over the device-to-device copy bandwidth
  measured in the same run.
- `e2e8b`: end to end on the Qwen3-8B shape with random weights, where a real drafter accepts nothing.
  BENCHMARK-ONLY forced acceptance (`ForcedAcceptance`): the engine's own (random) drafter drafts and
  the target verifies every step as usual, but the first --accept drafts of each block are accepted
  whatever the target says, so speculation does its real work at a chosen acceptance length. Only the
  speed means something there; the serving path never does this.
- `smollm2`: end to end on SmolLM2-135M-Instruct with its shipped drafter (benchmarks/e2e.py's run).
- `profile`: where the step's time goes (benchmarks/step_profile.py), for each --profile-configs
  (batch x window, default 1x1,8x1,64x1,1x8) with --context cached tokens a request: the step (forward
  + argmax) replayed from its CUDA graph and timed with CUDA events; an eager torch.profiler run whose
  kernels are grouped by category (each GEMM by its projection: qkv, o, gate_up, down, lm_head;
  attention and its split combine, rmsnorm, rotary_store_kv, silu_mul, embedding, layout, sampling,
  copies, other), their sum against the replay (the rest is gaps between kernels) and each category's
  excess over its share of the floor; the replay profiled too, where the profiler sees inside graphs;
  each GEMM's achieved bandwidth against the copy bandwidth and against F.linear alone at its shape
  (M = every config's token count). --trace adds gzipped chrome traces of the first batch-1 config
  (eager and replay). `--device cpu --shape tiny` runs it on the CPU (tests/test_step_profile.py),
  where the profiler sees CPU ops and there are no graphs.

--shape picks the random checkpoint (qwen3-8b; smollm2: SmolLM2-135M's sizes in the Qwen3 layout; or
tiny: 2 layers, hidden 64) of step, e2e8b and profile. Writes results.json and results.md to --out;
every part writes what it measured even if a later one fails, and no part (no profile piece) starts
after --budget-s (0: no limit).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import e2e  # noqa: E402
import step_profile  # noqa: E402
import tp_gpu  # noqa: E402

from dspark import LLM, EngineConfig  # noqa: E402
from dspark.kernels import ops  # noqa: E402
from dspark.kernels.runtime import load_kernels  # noqa: E402
from dspark.runner.model_runner import ModelRunner  # noqa: E402
from dspark.spec.drafts import Drafts  # noqa: E402

# --shape: the random checkpoint's architecture and its name in the tables.
SHAPES = {
    "qwen3-8b": (tp_gpu.QWEN3_8B, "Qwen3-8B"),
    "smollm2": (tp_gpu.SMOLLM2, "SmolLM2-135M sizes (Qwen3 layout)"),
    "tiny": (tp_gpu.TINY, "tiny (2 layers, hidden 64)"),
}


def copy_bandwidth_gbs(device: torch.device, size_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (GB/s), best of several."""
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(8):
        step_profile.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        step_profile.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


def make_step(batch: int, window: int, context: int, page_size: int, vocab: int, seed: int):
    """`batch` windows of `window` tokens after `context` cached positions, logits at every window row."""
    tokens_each = context + window
    pages = tp_gpu.request_pages(batch, tokens_each, page_size)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, window), generator=generator).tolist()
    return tp_gpu.step(tokens, [context] * batch, pages, all_logits=True)


def time_forward(runner: ModelRunner, step, repeats: int) -> float:
    """Median seconds of runner.forward (logits stay on the device), after two warm-ups (captures)."""
    for _ in range(2):
        runner.forward(step)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def part_step(args: argparse.Namespace, checkpoint: Path, report: dict) -> None:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_gbs(device)
    report["copy_bandwidth_GBs"] = bandwidth
    batches = [int(b) for b in args.step_batches.split(",")]
    windows = [int(w) for w in args.step_windows.split(",")]
    max_tokens = max(batches) * max(windows)
    pages_needed = max(batches) * -(-(args.context + max(windows)) // 16)
    config = EngineConfig(
        model=str(checkpoint),
        spec_mode="off",
        dtype="bfloat16",
        device="cuda",
        num_kv_pages=pages_needed,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max_tokens,
        cuda_graph_max_tokens=max_tokens,
    )
    runner = ModelRunner.create(config, device, torch.bfloat16)
    cfg = runner.model_config
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in runner.model.named_parameters() if "embed_tokens" not in n
    )
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    graphs = runner.graphs
    rows = report.setdefault("step", [])
    paths = args.kernel_paths.split(",")
    for batch in batches:
        for window in windows:
            step = make_step(batch, window, args.context, 16, cfg.vocab_size, batch * 31 + window)
            floor_s = (weight_bytes + batch * (args.context + window) * kv_bytes_per_token) / (
                bandwidth * 1e9
            )
            # The kernel paths side by side at each shape, each captured afresh.
            for path in paths:
                with kernel_path(path):
                    graphs.release()
                    graph_s = time_forward(runner, step, args.repeats)
                    runner.graphs = None
                    eager_s = time_forward(runner, step, max(3, args.repeats // 3))
                    runner.graphs = graphs
                row = {
                    "batch": batch,
                    "window": window,
                    "tokens": batch * window,
                    "kernels": path,
                    "floor_ms": floor_s * 1e3,
                    "graph_ms": graph_s * 1e3,
                    "eager_ms": eager_s * 1e3,
                    "graph_vs_floor": graph_s / floor_s,
                }
                rows.append(row)
                print("step", json.dumps(row), flush=True)
    graphs.release()
    del runner, graphs
    torch.cuda.empty_cache()


# --kernel-paths: switches set away from their defaults, by (module, name): the rows up to which a
# projection takes the skinny-product kernel (ops.FEW_ROWS, ops.SMALL_WEIGHT_ROWS), SwiGLU's activation
# in the gate/up kernel's epilogue (ops.SILU_IN_GATE_UP), dependent launches (common.DEPENDENT_LAUNCH)
# and each kernel letting the next launch once it has waited (common.LAUNCH_NEXT_EARLY).
KERNEL_PATHS: dict[str, dict[tuple[str, str], object]] = {
    "gemv": {},  # the defaults
    # the kernel for 1-8 rows only (the default before session 55)
    "gemv8": {("ops", "FEW_ROWS"): 8, ("ops", "SMALL_WEIGHT_ROWS"): 8},
    # 1-16 rows for every weight (session 55's default)
    "gemv16": {("ops", "FEW_ROWS"): 16, ("ops", "SMALL_WEIGHT_ROWS"): 16},
    "gemv64": {("ops", "FEW_ROWS"): 64},  # up to 64 rows for every weight (gemv.MAX_ROWS)
    "no-early": {("common", "LAUNCH_NEXT_EARLY"): False},  # the next kernel launches as this one ends
    "gemv-apart": {("ops", "SILU_IN_GATE_UP"): False},  # the activation as a kernel of its own
    "no-pdl": {("common", "DEPENDENT_LAUNCH"): False},  # each kernel launched after the one before ended
    # F.linear for every projection, no dependent launches
    "cublas": {
        ("ops", "FEW_ROWS"): 0,
        ("ops", "SMALL_WEIGHT_ROWS"): 0,
        ("ops", "SILU_IN_GATE_UP"): False,
        ("common", "DEPENDENT_LAUNCH"): False,
    },
}


@contextlib.contextmanager
def kernel_path(name: str) -> Iterator[None]:
    """Run the block with the switches of KERNEL_PATHS[name] set, then restore them."""
    kernels = load_kernels()  # kernel modules are imported through the runtime only
    modules = {"ops": ops, "common": kernels.common}
    changes = KERNEL_PATHS[name]
    saved = {key: getattr(modules[key[0]], key[1]) for key in changes}
    for (module, switch), value in changes.items():
        setattr(modules[module], switch, value)
    try:
        yield
    finally:
        for (module, switch), value in saved.items():
            setattr(modules[module], switch, value)


def part_profile(
    args: argparse.Namespace,
    checkpoint: Path,
    report: dict,
    save: Callable[[], None],
    deadline: float | None,
) -> None:
    """Where the step's time goes per --profile-configs (step_profile.run_profile), in report["profile"]."""
    device = torch.device(args.device)
    # A CPU copy of 2 GiB would take long for nothing: the tiny CPU run only needs a figure.
    bandwidth = copy_bandwidth_gbs(device, 2 << 30 if device.type == "cuda" else 64 << 20)
    report.setdefault("copy_bandwidth_GBs", bandwidth)
    configs = step_profile.parse_configs(args.profile_configs)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_tokens = max(b * w for b, w in configs)
    max_batch = max(b for b, _ in configs)
    max_window = max(w for _, w in configs)
    config = EngineConfig(
        model=str(checkpoint),
        spec_mode="off",
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        device=device.type,
        num_kv_pages=max_batch * -(-(args.context + max_window) // 16),
        max_num_seqs=max_batch,
        max_num_batched_tokens=max_tokens,
        cuda_graph_max_tokens=max_tokens,
    )
    runner = ModelRunner.create(config, device, dtype)
    if args.emulate_graphs:  # the graph-replay path on the CPU, for its test
        from dspark.runner.cuda_graphs import CudaGraphs

        runner.use_graphs(CudaGraphs(runner.model, runner.cache, device, max_tokens, max_batch, emulate=True))
    vocab = runner.model_config.vocab_size
    section = report.setdefault("profile", {})
    section.update(
        shape=args.shape,
        dtype=str(dtype).removeprefix("torch."),
        context=args.context,
        device=report["device"],
        copy_bandwidth_GBs=bandwidth,
    )
    try:
        step_profile.run_profile(
            runner,
            configs,
            lambda batch, window: make_step(batch, window, args.context, 16, vocab, batch * 31 + window),
            args.context,
            bandwidth,
            section,
            report["errors"],
            save,
            repeats=args.repeats,
            steps=args.profile_steps,
            trace_dir=args.out if args.trace else None,
            deadline=deadline,
        )
    finally:
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()


class ForcedAcceptance:
    """BENCHMARK-ONLY: every block's first `accept` drafts are accepted whatever the target says.

    The engine's own (random) drafter drafts and the target verifies as usual; `ops.greedy_accept` is
    wrapped so the target's choices at the first `accept` window positions read as the drafts, and the
    bonus is the target's real choice after them. Confidences are set high for those positions and low
    after, so compact under a non-flat SPS table plans to verify about `accept` + 1 drafts (under the
    flat one, which e2e8b runs, it verifies every draft, drafted apart: this wrapper is not a
    `DSparkProposer`, so nothing drafts inside the step). The output is NOT the target's greedy
    output (a random model has no meaningful continuation); only the speed means something. The serving
    path never does this."""

    def __init__(self, inner, accept: int) -> None:
        self.inner = inner
        self.accept = accept
        self.block_size = inner.block_size
        self.target_layer_ids = inner.target_layer_ids

    def propose(self, seqs, length=None) -> Drafts:
        """The real drafter's block, with the forced confidences."""
        proposal = self.inner.propose(seqs, length)
        block_size = self.block_size
        proposal.confidences[:] = torch.tensor([0.95 if k < self.accept else 0.05 for k in range(block_size)])
        # Without lengths: the random drafter's own early stop would cap the forced blocks.
        return dataclasses.replace(proposal, lengths=None)

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The real drafter keeps its context as usual."""
        self.inner.inject(features, positions, slots)


@contextlib.contextmanager
def forced_greedy_accept(accept: int):
    """Within the block, ops.greedy_accept accepts min(accept, verify_len) drafts of every window."""
    from dspark.kernels import ops

    real = ops.greedy_accept

    def forced(drafts, target_tokens, cu_windows, verify_lens, commit_caps=None):
        # Vectorised on the tokens' device (no host sync): forced positions get the drafts, every other
        # lane writes to one spare slot past the end.
        device, num_tokens = target_tokens.device, target_tokens.shape[0]
        k = torch.arange(drafts.shape[1], device=device)
        forced_here = k[None, :] < verify_lens.to(device).clamp(max=accept)[:, None]
        index = torch.where(forced_here, cu_windows.to(device)[:-1, None] + k[None, :], num_tokens)
        padded = torch.cat([target_tokens, target_tokens.new_zeros(1)])
        padded.scatter_(0, index.flatten(), torch.where(forced_here, drafts.to(device), 0).flatten())
        return real(drafts, padded[:num_tokens], cu_windows, verify_lens, commit_caps)

    ops.greedy_accept = forced
    try:
        yield
    finally:
        ops.greedy_accept = real


def write_placeholder_tokenizer(checkpoint: Path, vocab_size: int) -> None:
    """A word-level tokenizer naming every id ("t0", "t1", ...): the random model has no text, but the
    engine detokenizes what it streams."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = checkpoint / "tokenizer.json"
    if path.is_file():
        return
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))


def part_e2e8b(args: argparse.Namespace, checkpoint: Path, report: dict) -> None:
    from dspark.runner.models.hf_config import ModelConfig
    from dspark.spec.draft_checkpoint import create_random_drafter, fresh_draft_config, save_drafter

    target_cfg = ModelConfig.load(checkpoint)
    write_placeholder_tokenizer(checkpoint, target_cfg.vocab_size)
    draft_dir = Path(args.work) / "qwen3-8b-random-drafter"
    if not (draft_dir / "config.json").is_file():
        save_drafter(create_random_drafter(fresh_draft_config(target_cfg, 7, 1)), draft_dir)
    batches = [int(b) for b in args.e2e_batches.split(",")]
    base = EngineConfig(
        model=str(checkpoint),
        draft_model=str(draft_dir),
        dtype="bfloat16",
        device="cuda",
        num_kv_pages=max(batches) * -(-(args.prompt_len + args.max_tokens + 16) // 16) + 64,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(512, max(batches) * 8),
    )
    rows = report.setdefault("e2e8b", [])
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, target_cfg.vocab_size, (max(batches), args.prompt_len), generator=gen).tolist()
    engines = {
        mode: LLM(base.replace(spec_mode=mode, adaptive_speculation=False))
        for mode in ("off", "static", "compact")
    }
    for mode in ("static", "compact"):
        engine = engines[mode].engine
        engine.proposer = ForcedAcceptance(engine.proposer, args.accept)
    for batch in batches:
        ids = prompts[:batch]
        phases: dict[str, dict] = {mode: {} for mode in engines}
        plain_tps, _, _ = e2e._time_engine(engines["off"], ids, args.max_tokens, phases["off"])
        row = {"batch": batch, "off": plain_tps, "accept": args.accept, "phases_ms": phases}
        for mode in ("static", "compact"):
            with forced_greedy_accept(args.accept):
                tps, _, stats = e2e._time_engine(engines[mode], ids, args.max_tokens, phases[mode])
            row[mode] = tps
            row[f"{mode}_tau"] = stats["mean_committed_per_step"]
        rows.append(row)
        print("e2e8b", json.dumps(row), flush=True)
    for llm in engines.values():
        llm.engine.close()
    del engines
    torch.cuda.empty_cache()
    if not args.no_peer:
        for row in rows:
            ids = prompts[: row["batch"]]
            row["transformers"] = e2e._time_transformers(
                str(checkpoint), ids, args.max_tokens, "cuda", torch.bfloat16
            )
            print("e2e8b transformers", json.dumps(row), flush=True)


def part_smollm2(args: argparse.Namespace, report: dict) -> None:
    out = Path(args.work) / "smollm2-e2e.json"
    e2e.main(
        [
            "--device",
            "cuda",
            "--batch-sizes",
            args.e2e_batches,
            "--max-tokens",
            str(args.max_tokens),
            "--out",
            str(out),
            "--phases",
            "--sustained",
            str(args.sustained),
            "--block-size",
            str(args.smollm2_block_size),
            "--draft-vocab-size",
            str(args.smollm2_draft_vocab_size),
            "--repeats",
            str(args.e2e_repeats),
        ]
    )
    report["smollm2"] = json.loads(out.read_text())["rows"]


def markdown(report: dict) -> str:
    lines = [f"# GPU engine on {report['device']} ({report['date']})", ""]
    shape = SHAPES.get(report["args"].get("shape", "qwen3-8b"), (None, "?"))[1]
    if "copy_bandwidth_GBs" in report:
        lines.append(
            f"Device-to-device copy bandwidth (read + write): {report['copy_bandwidth_GBs']:.0f} GB/s."
        )
        lines.append("")
    if report.get("step"):
        lines += [
            f"## One target step, {shape} shape, bf16, {report['args']['context']} cached tokens a request",
            "",
            "Kernels: `gemv` the defaults (the skinny-product kernel at a few rows with SwiGLU's activation "
            "in the gate/up kernel, dependent launches, each kernel letting the next launch once it has "
            "waited); `no-early` the next kernel launched only as one ends (session 27's default), "
            "`gemv-apart` the activation as a kernel of its own, `no-pdl` no dependent launches, `cublas` "
            "F.linear for every projection and no dependent launches.",
            "",
            "| batch | window | tokens | kernels | floor ms | graph ms | eager ms | graph / floor |",
            "|---:|---:|---:|---|---:|---:|---:|---:|",
        ]
        for r in report["step"]:
            lines.append(
                f"| {r['batch']} | {r['window']} | {r['tokens']} | {r.get('kernels', 'gemv')} "
                f"| {r['floor_ms']:.2f} | {r['graph_ms']:.2f} | {r['eager_ms']:.2f} "
                f"| {r['graph_vs_floor']:.2f} |"
            )
        lines.append("")
    if report.get("profile"):
        lines += step_profile.markdown(report["profile"])
    for key, title in (
        ("e2e8b", f"{shape} shape, random weights, forced acceptance"),
        ("smollm2", "SmolLM2"),
    ):
        if not report.get(key):
            continue
        lines += [
            f"## End to end: {title}, {report['args']['max_tokens']} greedy tokens per request (tok/s)",
            "",
            "static and compact draft on every step; default is the serve default's spec_mode behind the "
            "adaptive gate (SmolLM2 rows only).",
            "",
            "| batch | off | static (τ) | compact (τ) | default (τ) | transformers | compact / off "
            "| default / off | compact / transformers |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        nan = float("nan")
        for r in report[key]:
            peer = r.get("transformers")
            default, default_tau = r.get("default", nan), r.get("default_tau", nan)
            lines.append(
                f"| {r['batch']} | {r['off']:.1f} | {r['static']:.1f} ({r['static_tau']:.2f}) | "
                f"{r['compact']:.1f} ({r['compact_tau']:.2f}) | {default:.1f} ({default_tau:.2f}) "
                f"| {peer or nan:.1f} | {r['compact'] / r['off']:.2f} | {default / r['off']:.2f} | "
                f"{(r['compact'] / peer) if peer else nan:.2f} |"
            )
        lines.append("")
    steady = [r for r in report.get("smollm2", []) if "sustained_off" in r]
    if steady:
        lines += [
            "## SmolLM2 under steady load: the batch size in flight, a finished request's slot refilled at "
            "once (tok/s, τ, ratio to off)",
            "",
            *e2e.steady_load_table(steady),
            "",
            "Their steady windows (first finished request to last admitted prompt):",
            "",
            *e2e.steady_load_table(steady, "_steady"),
            "",
        ]
    for key in ("e2e8b", "smollm2"):
        rows = [r for r in report.get(key, []) if r.get("phases_ms")]
        if not rows:
            continue
        names = ("schedule", "draft", "plan", "layout", "target", "accept", "emit")
        lines += [
            f"### Where a step's time goes, {key} (ms per step, device synchronised per phase)",
            "",
            "| batch | mode | steps | " + " | ".join(names) + " |",
            "|---:|---|---:|" + "---:|" * len(names),
        ]
        for r in rows:
            for mode, p in r["phases_ms"].items():
                cells = " | ".join(f"{p.get(n, 0.0):.2f}" for n in names)
                lines.append(f"| {r['batch']} | {mode} | {p.get('steps', 0):.0f} | {cells} |")
        lines.append("")
    for part, error in report.get("errors", {}).items():
        lines += [f"{part}: FAILED: {error.splitlines()[-1]}", ""]
    return "\n".join(lines)


def save_report(out: Path, report: dict) -> None:
    """results.json and results.md as they stand."""
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="step,e2e8b,smollm2")
    parser.add_argument("--work", default="/tmp/dspark-gpu-e2e")
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default /tmp/dspark-qwen3-8b-random, or under --work"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--device", default="cuda", help="profile only: cpu runs it without a GPU")
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no part or piece after this")
    parser.add_argument(
        "--profile-configs", default="1x1,8x1,64x1,1x8", help="profile: batch x window, comma-separated"
    )
    parser.add_argument("--profile-steps", type=int, default=3, help="profile: steps per profiler run")
    parser.add_argument("--trace", action="store_true", help="profile: chrome traces of batch 1 (gzipped)")
    parser.add_argument(
        "--emulate-graphs",
        action="store_true",
        help="profile on the CPU: the graph path, run eagerly (tests)",
    )
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--step-batches", default="1,8,32,128,256")
    parser.add_argument("--step-windows", default="1,2,4,8")
    parser.add_argument(
        "--kernel-paths",
        default="gemv",
        help=f"step: few-row projection paths side by side, comma-separated of {','.join(KERNEL_PATHS)}",
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--e2e-batches", default="1,4,16,64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--accept", type=int, default=4, help="e2e8b: forced accepted drafts per block")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument(
        "--sustained", type=int, default=4, help="smollm2: steady-load runs with K x batch requests"
    )
    parser.add_argument(
        "--smollm2-block-size", type=int, default=0, help="smollm2: block_size (0: the drafter's)"
    )
    parser.add_argument(
        "--smollm2-draft-vocab-size",
        type=int,
        default=0,
        help="smollm2: draft_vocab_size (0: the drafter's default, -1: every token)",
    )
    parser.add_argument(
        "--e2e-repeats", type=int, default=3, help="smollm2: timed runs per figure (the median counts)"
    )
    args = parser.parse_args(argv)
    started_all = time.monotonic()
    deadline = started_all + args.budget_s if args.budget_s > 0 else None
    if args.checkpoint is None:
        default = Path("/tmp/dspark-qwen3-8b-random") if args.shape == "qwen3-8b" else None
        args.checkpoint = default or Path(args.work) / f"dspark-{args.shape}-random"
    Path(args.work).mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    on_gpu = args.device.startswith("cuda") and torch.cuda.is_available()
    report: dict = {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if on_gpu else args.device,
        "torch": torch.__version__,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "errors": {},
    }
    parts = args.parts.split(",")
    checkpoint = None
    if {"step", "e2e8b", "profile"} & set(parts):
        started = time.perf_counter()
        checkpoint = tp_gpu.write_checkpoint(args.checkpoint, SHAPES[args.shape][0], "bfloat16")
        print(f"checkpoint ready in {time.perf_counter() - started:.0f} s", flush=True)
    for part in parts:
        started = time.perf_counter()
        if deadline is not None and time.monotonic() > deadline:
            report["errors"][part] = "skipped: --budget-s ran out"
            continue
        try:
            if part == "step":
                part_step(args, checkpoint, report)
            elif part == "e2e8b":
                part_e2e8b(args, checkpoint, report)
            elif part == "smollm2":
                part_smollm2(args, report)
            elif part == "profile":
                part_profile(args, checkpoint, report, lambda: save_report(args.out, report), deadline)
            else:
                raise ValueError(f"unknown part {part}")
        except BaseException:  # noqa: BLE001 - keep what the other parts measured
            report["errors"][part] = traceback.format_exc()
            print(report["errors"][part], flush=True)
        print(f"part {part}: {time.perf_counter() - started:.0f} s", flush=True)
        save_report(args.out, report)
    save_report(args.out, report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
