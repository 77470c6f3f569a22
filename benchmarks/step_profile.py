"""Where one target step's device time goes: per-kernel categories, GEMM bandwidth, gaps (gpu_e2e --parts
profile).

For each (batch, window) config a step is `ModelRunner.forward` plus the argmax of its logits (what
`ModelRunner.run` does for the engine), each request with `context` cached tokens:

- timed as the engine runs it (a CUDA graph replay, then the LM head eagerly) with CUDA events, with no
  profiler (`graph_ms`; on the CPU, which has no graphs, the eager step's wall time);
- profiled eagerly under torch.profiler with every module and op of interest wrapped in a
  `record_function` scope (`annotated`), so each kernel is put in a category by its name
  (`kernel_category`) and each GEMM kernel in the projection (qkv, o, gate_up, down, lm_head) whose
  scope launched it; the kernel sum of that table against `graph_ms` leaves the gaps between kernels;
- profiled again as a graph replay: whether the replay's kernels are visible to the profiler depends
  on the CUDA and torch versions; when they are, their categories (GEMMs labelled by their order)
  appear beside the eager ones.

The floor is part_step's: weights (but the embedding) and the KV cache the step attends to, over the
measured copy bandwidth; split per category (each projection's weights, attention's KV), so each
category's excess over its floor, and the gaps, add up to graph_ms - floor. Each GEMM's achieved
bandwidth (its weights, input and output bytes over its kernel time) is set against the copy bandwidth
and against `torch.nn.functional.linear` alone at the same shape (what the model's linears call),
replayed from a CUDA graph over enough weight copies that none is read from L2.

On the CPU the profiler sees CPU ops, not kernels: each op's own time goes to the scope it ran in.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import math
import os
import re
import shutil
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Display order of the kernel categories (a GEMM's category is "gemm:<projection>").
CATEGORIES = (
    "gemm",
    "attention",
    "attention_combine",
    "rmsnorm",
    "rotary_store_kv",
    "silu_mul",
    "embedding",
    "layout",
    "sampling",
    "copies",
    "other",
)
PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
# One layer's GEMMs in launch order; the LM head follows the last layer.
LAYER_GEMMS = ("qkv", "o", "gate_up", "down")
SCOPE_PREFIX = "dspark::"
# Scope name -> category of what runs inside it (projections are GEMMs).
SCOPES = {
    "embedding": "embedding",
    "rmsnorm": "rmsnorm",
    "rotary_store_kv": "rotary_store_kv",
    "attention": "attention",
    "silu_mul": "silu_mul",
    "argmax": "sampling",
    **{p: "gemm" for p in PROJECTIONS},
}
TRACE_LIMIT_BYTES = 15 << 20
# CUDA runtime and driver calls (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, cudaGraphLaunch).
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")
# Device-side waits some profilers record (kineto's CUDA sync events): time, but no kernel's.
_DEVICE_WAIT = re.compile(r"^(Event|Stream|Context|Device) (Sync|Wait)")
_GEMM_MARKS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "dot_kernel", "matmul")
_SAMPLING_MARKS = ("argmax", "argmin", "softmax", "topk", "sampl", "accept", "_race_", "multinomial")
# CPU ops: ATen's products, MKL's packed GEMM and oneDNN's (`layers.PACKED`, `layers.ONEDNN`: a linear's
# paths on an x86 CPU), and the CPU kernel's scopes (`layers.KERNEL`, named while a profiler runs).
_CPU_GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
    "aten::baddbmm",
    "mkl::_mkl_linear",
    "mkldnn::_linear_pointwise",
    "cpu_kernel::linear_rows",
    "cpu_kernel::silu_mul_rows",  # the gate/up product with SwiGLU in its epilogue
)
_CPU_COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::fill_", "aten::zero_")


def kernel_category(name: str) -> str:
    """The category of a CUDA kernel (or CPU op) by its name alone: one of CATEGORIES."""
    n = name.lower()
    if n.startswith(("memcpy", "memset")):
        return "copies"
    if "combine" in n and any(m in n for m in ("split", "attention", "attn", "flash")):
        return "attention_combine"
    if any(m in n for m in ("attention", "flash_fwd", "fmha", "attn")):
        return "attention"
    if any(m in n for m in ("rms_norm", "rmsnorm", "layer_norm", "layernorm")):
        return "rmsnorm"
    if any(m in n for m in ("rotary", "store_kv", "reshape_and_cache")):
        return "rotary_store_kv"
    if any(m in n for m in ("silu", "swiglu", "act_and_mul")):
        return "silu_mul"
    if any(m in n for m in ("_window_bounds", "_positions_slots", "_verify_tokens", "build_window_layout")):
        return "layout"
    if any(m in n for m in _SAMPLING_MARKS):
        return "sampling"
    if any(m in n for m in ("indexselect", "index_select", "embedding")):
        return "embedding"
    if any(m in n for m in _GEMM_MARKS) or "splitkreduce" in n or n.startswith(_CPU_GEMM_OPS):
        return "gemm"
    if n in _CPU_COPY_OPS or any(m in n for m in ("copy", "fillfunctor", "memcpy", "memset")):
        return "copies"
    return "other"


def is_split_k_reduce(name: str) -> bool:
    """Whether a GEMM kernel is the reduction pass of a split-K GEMM (it belongs to the GEMM before)."""
    n = name.lower()
    return "splitkreduce" in n or ("reduce" in n and "cublas" in n)


@dataclass
class Kernel:
    """One device kernel (or, on the CPU, one op's own time) of a profile."""

    name: str
    start_us: float
    dur_us: float
    # When (host clock) it was launched, None if unknown; and the innermost scope around that moment.
    launch_us: float | None = None
    scope: str | None = None
    projection: str | None = None
    cpu_op: bool = False

    @property
    def category(self) -> str:
        """The category key: the name decides on the GPU, the scope on the CPU (whose reference ops are
        generic aten ops), the other one when the first says nothing."""
        by_name = kernel_category(self.name)
        by_scope = SCOPES.get(self.scope or "")
        if self.cpu_op:
            category = by_scope or by_name
        else:
            category = by_name if by_name != "other" else (by_scope or "other")
        if category == "gemm":
            return f"gemm:{self.projection or '?'}"
        return category


# Scopes ------------------------------------------------------------------------------------------------


def _scoped_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(scope, module) for every module whose forward is one category of work."""
    yield "embedding", model.embed_tokens
    yield "rmsnorm", model.norm
    yield "lm_head", model.lm_head
    for layer in model.layers:
        yield "rmsnorm", layer.input_layernorm
        yield "rmsnorm", layer.post_attention_layernorm
        yield "qkv", layer.self_attn.qkv_proj
        yield "o", layer.self_attn.o_proj
        yield "gate_up", layer.mlp.gate_up_proj
        yield "down", layer.mlp.down_proj


# A projection's methods that run it with the op after it (SwiGLU's activation), called by the layers
# instead of forward: wrapped in the projection's scope.
_FUSED_METHODS = ("forward_silu_mul",)
# ops called by the layers as plain functions (no module to hook): op name -> scope.
_SCOPED_OPS = {"rotary_store_kv": "rotary_store_kv", "paged_attention": "attention", "silu_mul": "silu_mul"}


@contextlib.contextmanager
def annotated(model: torch.nn.Module) -> Iterator[None]:
    """Within: every scoped module's forward and scoped op call runs inside a `record_function` named
    SCOPE_PREFIX + scope (hooks and wrappers, removed on exit; the model's code is untouched)."""
    from dspark.kernels import ops

    open_scopes: list[torch.profiler.record_function] = []

    def enter(scope: str) -> Callable:
        def pre_hook(module: torch.nn.Module, args: tuple) -> None:
            ctx = torch.profiler.record_function(SCOPE_PREFIX + scope)
            ctx.__enter__()
            open_scopes.append(ctx)

        return pre_hook

    def leave(module: torch.nn.Module, args: tuple, output: object) -> None:
        open_scopes.pop().__exit__(None, None, None)

    def wrapped(real: Callable, scope: str) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            with torch.profiler.record_function(SCOPE_PREFIX + scope):
                return real(*args, **kwargs)

        return call

    handles = []
    real_ops = {name: getattr(ops, name) for name in _SCOPED_OPS}
    wrapped_methods: list[tuple[torch.nn.Module, str]] = []
    try:
        for scope, module in _scoped_modules(model):
            handles.append(module.register_forward_pre_hook(enter(scope)))
            handles.append(module.register_forward_hook(leave))
            for method in _FUSED_METHODS:
                if hasattr(module, method):
                    setattr(module, method, wrapped(getattr(module, method), scope))
                    wrapped_methods.append((module, method))
        for name, scope in _SCOPED_OPS.items():
            setattr(ops, name, wrapped(real_ops[name], scope))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, method in wrapped_methods:
            delattr(module, method)  # the class's method again
        for name, real in real_ops.items():
            setattr(ops, name, real)
        while open_scopes:  # a forward that raised between a pre-hook and its hook
            open_scopes.pop().__exit__(None, None, None)


# Reading a profile -------------------------------------------------------------------------------------


def _span(event: object) -> tuple[float, float]:
    return float(event.time_range.start), float(event.time_range.end)


def _is_device(event: object) -> bool:
    return str(event.device_type).rsplit(".", 1)[-1] in ("CUDA", "HIP")


class _Scopes:
    """The scope annotations of a profile, to find the innermost one around a host moment."""

    def __init__(self, events: Iterable[object]) -> None:
        spans = sorted(
            (*_span(e), e.name[len(SCOPE_PREFIX) :])
            for e in events
            if e.name.startswith(SCOPE_PREFIX) and e.name[len(SCOPE_PREFIX) :] in SCOPES
        )
        self.starts = [s[0] for s in spans]
        self.spans = spans

    def at(self, moment: float | None) -> str | None:
        """The innermost scope open at `moment`: scopes nest, so walking back from the last one that
        started before it, the first still open is the innermost."""
        if moment is None:
            return None
        i = bisect.bisect_right(self.starts, moment) - 1
        while i >= 0:
            start, end, scope = self.spans[i]
            if end >= moment:
                return scope
            i -= 1
        return None


def collect_kernels(events: Sequence[object], device_type: str) -> list[Kernel]:
    """The kernels of a profile (`prof.events()`), in start order, each with its launching scope.

    CUDA: every device-side event; it was launched when the runtime call of the same correlation id
    ran (cudaLaunchKernel, cudaMemcpyAsync, cudaGraphLaunch, ...), else when the CPU op it is listed
    under (its `kernels`) ran. CPU: every op but the scopes, with its own time (less its children)."""
    scopes = _Scopes(events)
    kernels: list[Kernel] = []
    if device_type != "cuda":
        for e in events:
            if e.name.startswith(SCOPE_PREFIX) or _is_device(e) or _RUNTIME_CALL.match(e.name):
                continue
            start, end = _span(e)
            own = (end - start) - sum(_span(c)[1] - _span(c)[0] for c in getattr(e, "cpu_children", []))
            if own > 0:
                kernels.append(Kernel(e.name, start, own, start, scopes.at(start), cpu_op=True))
        return sorted(kernels, key=lambda k: k.start_us)
    launches: dict[int, tuple[float, str]] = {}
    owners: dict[tuple[str, float], list[float]] = {}
    for e in events:
        if _is_device(e):
            continue
        if _RUNTIME_CALL.match(e.name) and getattr(e, "id", None) is not None:
            launches.setdefault(int(e.id), (_span(e)[0], e.name))
        for k in getattr(e, "kernels", None) or []:
            owners.setdefault((k.name, float(k.duration)), []).append(_span(e)[0])
    # A scope shows on the device timeline too (the profiler's gpu_user_annotation, spanning the kernels
    # it launched): it is no kernel, and counting it would count its kernels twice.
    device = [
        e
        for e in events
        if _is_device(e)
        and _span(e)[1] > _span(e)[0]
        and not _DEVICE_WAIT.match(e.name)
        and not e.name.startswith(SCOPE_PREFIX)
    ]
    by_id = {id(e): launches.get(int(e.id)) for e in device if getattr(e, "id", None) is not None}
    # Ids are trusted only if every kernel they pair with a runtime call pairs with a call of its kind
    # (a launch, a memcpy, a memset) made before it started: profilers that number the two differently
    # fall back to owners.
    trusted = all(
        _launch_matches(e.name, by_id[id(e)][1]) and by_id[id(e)][0] <= _span(e)[0]
        for e in device
        if by_id.get(id(e))
    )
    for e in device:
        start, end = _span(e)
        pair = by_id.get(id(e)) if trusted else None
        launch = pair[0] if pair else None
        if launch is None:
            listed = owners.get((e.name, end - start))
            launch = listed.pop(0) if listed else None
        kernels.append(Kernel(e.name, start, end - start, launch, scopes.at(launch)))
    return sorted(kernels, key=lambda k: k.start_us)


def _launch_matches(kernel: str, call: str) -> bool:
    """Whether runtime call `call` is of the kind that starts device event `kernel` (a graph launch
    starts every kind)."""
    kernel, call = kernel.lower(), call.lower()
    if "graphlaunch" in call:
        return True
    for kind in ("memcpy", "memset"):
        if kernel.startswith(kind):
            return kind in call
    return "launch" in call


def _order_labels(gemms: Sequence[Kernel], num_layers: int) -> list[str] | None:
    """Projection labels by launch order when the GEMM count fits whole steps of qkv, o, gate_up, down
    per layer then the LM head (a split-K reduction goes with the GEMM before it); else None."""
    order = [*LAYER_GEMMS * num_layers, "lm_head"]
    main = [k for k in gemms if not is_split_k_reduce(k.name)]
    if not main or len(main) % len(order) or any(k.cpu_op for k in gemms):
        return None
    labels, index = [], 0
    for k in gemms:
        if not is_split_k_reduce(k.name) or not labels:
            index += 1
        labels.append(order[(index - 1) % len(order)])
    return labels


def label_gemms(kernels: Sequence[Kernel], num_layers: int) -> str:
    """Set each GEMM kernel's projection: by its launching scope where every GEMM has one, else by
    launch order (`_order_labels`); returns how, with how far the two agree when both work."""
    gemms = [k for k in kernels if k.category.startswith("gemm")]
    if not gemms:
        return "none"
    order = _order_labels(gemms, num_layers)
    if all(k.scope in PROJECTIONS for k in gemms):
        labels: list[str | None] = [k.scope for k in gemms]
        method = "scope"
        if order is not None:
            agree = sum(a == b for a, b in zip(labels, order, strict=True)) / len(labels)
            method += f" (launch order agrees on {agree:.0%})"
    elif order is not None:
        labels, method = list(order), "launch order"
    else:
        labels = [k.scope if k.scope in PROJECTIONS else None for k in gemms]
        method = "scope, partly" if any(labels) else "none"
    for k, label in zip(gemms, labels, strict=True):
        k.projection = label
    return method


def summarize(kernels: Sequence[Kernel], steps: int, top: int = 3) -> dict[str, dict]:
    """Per category key: kernels and ms per step, and its `top` kernel names by time."""
    table: dict[str, dict] = {}
    for k in kernels:
        row = table.setdefault(k.category, {"count": 0, "ms": 0.0, "names": {}})
        row["count"] += 1
        row["ms"] += k.dur_us / 1e3
        row["names"][k.name[:200]] = row["names"].get(k.name[:200], 0.0) + k.dur_us / 1e3
    for row in table.values():
        row["count"] /= steps
        row["ms"] /= steps
        names = sorted(row["names"].items(), key=lambda item: -item[1])[:top]
        row["names"] = {name: ms / steps for name, ms in names}
    return dict(sorted(table.items(), key=lambda item: category_rank(item[0])))


def category_rank(key: str) -> tuple[int, int]:
    """Sort key of a category key: CATEGORIES order, projections in PROJECTIONS order."""
    base, _, projection = key.partition(":")
    first = CATEGORIES.index(base) if base in CATEGORIES else len(CATEGORIES)
    second = PROJECTIONS.index(projection) if projection in PROJECTIONS else len(PROJECTIONS)
    return first, second


# The model's bytes -------------------------------------------------------------------------------------


def parameter_category(name: str) -> str:
    """The category whose kernels read a parameter (the floor's split), by its name in the model."""
    for projection, marker in (
        ("qkv", "qkv_proj"),
        ("o", "o_proj"),
        ("gate_up", "gate_up_proj"),
        ("down", "down_proj"),
        ("lm_head", "lm_head"),
    ):
        if marker in name:
            return f"gemm:{projection}"
    if "q_norm" in name or "k_norm" in name:
        return "rotary_store_kv"  # q/k norms are fused into the rotary + store kernel
    if "norm" in name:
        return "rmsnorm"
    return "embedding" if "embed_tokens" in name else "other"


def floor_bytes(model: torch.nn.Module, kv_bytes: int) -> dict[str, int]:
    """Bytes a step must read per category: each parameter (not the embedding: a step reads a few rows
    of it) and the attended KV cache (`kv_bytes`), as part_step's floor counts them."""
    floors: dict[str, int] = {"attention": kv_bytes}
    for name, p in model.named_parameters():
        category = parameter_category(name)
        if category != "embedding":
            floors[category] = floors.get(category, 0) + p.numel() * p.element_size()
    return floors


@dataclass(frozen=True)
class GemmShape:
    """One projection's GEMM in a step: y[M, N] = x[M, K] W[N, K]^T, `calls` times a step."""

    projection: str
    m: int
    n: int
    k: int
    calls: int
    element_size: int

    @property
    def bytes_per_call(self) -> int:
        """Weights and input read, output written."""
        return (self.n * self.k + self.m * self.k + self.m * self.n) * self.element_size


def gemm_shapes(model: torch.nn.Module, tokens: int, logit_rows: int) -> list[GemmShape]:
    """The step's GEMMs by projection, from the model's weights."""
    layer = model.layers[0]
    weights = {
        "qkv": layer.self_attn.qkv_proj.weight,
        "o": layer.self_attn.o_proj.weight,
        "gate_up": layer.mlp.gate_up_proj.weight,
        "down": layer.mlp.down_proj.weight,
        "lm_head": model.lm_head.weight,
    }
    shapes = []
    for projection, w in weights.items():
        m, calls = (logit_rows, 1) if projection == "lm_head" else (tokens, len(model.layers))
        shapes.append(GemmShape(projection, m, w.shape[0], w.shape[1], calls, w.element_size()))
    return shapes


# Timing ------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for the device (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, repeats: int, warmups: int = 2) -> dict:
    """Median ms of `fn` by CUDA events around it (the device's view, host preparation included) and
    by the host's wall clock, each call from an idle device. CPU: wall clock for both."""
    for _ in range(warmups):
        fn()
    synchronize(device)
    events, walls = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            end.record()
        synchronize(device)
        walls.append((time.perf_counter() - began) * 1e3)
        events.append(start.elapsed_time(end) if device.type == "cuda" else walls[-1])
    return {"event_ms": statistics.median(events), "wall_ms": statistics.median(walls)}


def profile_calls(
    fn: Callable[[], object], device: torch.device, steps: int, trace: Path | None = None
) -> list[object]:
    """The events of `steps` calls of `fn` under torch.profiler (CUDA activities on a GPU), each call
    from an idle device; `trace`: also a gzipped chrome trace there (dropped if over TRACE_LIMIT_BYTES)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with torch.profiler.record_function(SCOPE_PREFIX + "step"):
                fn()
            synchronize(device)
    if trace is not None:
        export_trace(prof, trace)
    return list(prof.events())


def export_trace(prof: object, path: Path) -> None:
    """`prof`'s chrome trace gzipped at `path` (path ends .json.gz), removed when over the limit."""
    raw = path.with_suffix("")  # x.json.gz -> x.json
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as source, gzip.open(path, "wb", compresslevel=6) as sink:
        shutil.copyfileobj(source, sink)
    raw.unlink()
    if path.stat().st_size > TRACE_LIMIT_BYTES:
        path.unlink()
        raise RuntimeError(f"{path.name}: gzipped trace over {TRACE_LIMIT_BYTES >> 20} MiB, dropped")


def linear_alone(
    shape: GemmShape, device: torch.device, dtype: torch.dtype, bandwidth_gbs: float, calls: int = 24
) -> dict:
    """`F.linear` alone at `shape` (what ColumnParallelLinear / RowParallelLinear call): µs per call,
    replayed from a CUDA graph of `calls` calls (no launch gaps) that rotate over enough weight copies
    (>= 512 MiB in all) that no call reads its weights from L2. CPU: a plain loop, one copy."""
    weight_bytes = shape.n * shape.k * torch.empty(0, dtype=dtype).element_size()
    copies = min(16, max(1, math.ceil((512 << 20) / weight_bytes))) if device.type == "cuda" else 1
    generator = torch.Generator(device).manual_seed(0)
    weights = [
        torch.randn(shape.n, shape.k, device=device, dtype=dtype, generator=generator) * 0.02
        for _ in range(copies)
    ]
    x = torch.randn(shape.m, shape.k, device=device, dtype=dtype, generator=generator)
    calls = max(calls, copies)

    def run() -> None:
        for i in range(calls):
            F.linear(x, weights[i % copies])

    method, timed_fn = "eager loop", run
    if device.type == "cuda":
        run()  # cuBLAS picks and loads its kernel outside the capture
        torch.cuda.synchronize(device)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            method, timed_fn = "cuda graph", graph.replay
        except RuntimeError as exc:  # timed eagerly then: launch gaps show for the smallest GEMMs
            torch.cuda.synchronize(device)
            method = f"eager loop (capture failed: {str(exc).splitlines()[0][:120]})"
    timed = time_calls(timed_fn, device, repeats=7)
    us = timed["event_ms"] * 1e3 / calls
    gbs = shape.bytes_per_call / (us * 1e-6) / 1e9
    return {
        "projection": shape.projection,
        "m": shape.m,
        "n": shape.n,
        "k": shape.k,
        "us_per_call": us,
        "GBs": gbs,
        "of_copy_bandwidth": gbs / bandwidth_gbs,
        "weight_copies": copies,
        "method": method,
    }


# One config --------------------------------------------------------------------------------------------


def engine_step(runner: object, step: object) -> Callable[[], None]:
    """The step as the engine runs it: forward (a graph replay when the runner has graphs, then the LM
    head) and the argmax of the logits, which `ModelRunner.run` adds."""

    def run() -> None:
        result = runner.forward(step)
        with torch.profiler.record_function(SCOPE_PREFIX + "argmax"):
            result.logits.argmax(dim=-1)

    return run


def time_config(
    runner: object, step: object, batch: int, window: int, context: int, bandwidth_gbs: float, repeats: int
) -> dict:
    """One (batch, window) step timed with no profiler: the graph replay (CUDA events), eagerly, and
    its floor split by category."""
    model, device = runner.model, runner.device
    run = engine_step(runner, step)
    row: dict = {"batch": batch, "window": window, "tokens": batch * window, "device": device.type}
    graphs = runner.graphs
    if graphs is not None:
        timed = time_calls(run, device, repeats)
        row["graph_ms"], row["graph_wall_ms"] = timed["event_ms"], timed["wall_ms"]
    runner.graphs = None
    try:
        eager = time_calls(run, device, max(3, repeats // 3))
    finally:
        runner.graphs = graphs
    row["eager_ms"], row["eager_wall_ms"] = eager["event_ms"], eager["wall_ms"]
    # The step as the engine runs it: the graph replay, or eagerly where there are no graphs.
    row["step_ms"] = row.get("graph_ms", row["eager_ms"])
    row["step_timing"] = "eager, wall clock"
    if graphs is not None:
        row["step_timing"] = "graph replay, " + (
            "CUDA events" if device.type == "cuda" else "emulated, wall clock"
        )
    kv_token_bytes = 2 * len(model.layers) * model.num_local_kv_heads * model.config.head_dim
    kv_bytes = batch * (context + window) * kv_token_bytes * cache_element_size(runner.cache)
    floors_ms = {k: b / (bandwidth_gbs * 1e9) * 1e3 for k, b in floor_bytes(model, kv_bytes).items()}
    row["floor_by_category_ms"] = floors_ms
    row["floor_ms"] = sum(floors_ms.values())
    row["step_vs_floor"] = row["step_ms"] / row["floor_ms"]
    return row


def profile_config(
    row: dict, runner: object, step: object, bandwidth_gbs: float, steps: int, trace_dir: Path | None = None
) -> None:
    """Add to `row` (time_config's) the eager profile by category, the graph replay's where the profiler
    sees it, the excess over the floor per category and the GEMMs' bandwidth."""
    model, device = runner.model, runner.device
    batch, window = row["batch"], row["window"]
    run = engine_step(runner, step)
    graphs = runner.graphs
    runner.graphs = None
    try:
        with annotated(model):
            run()  # the hooks' first call outside the profile
            trace = trace_dir / f"trace-b{batch}-w{window}-eager.json.gz" if trace_dir else None
            events = profile_calls(run, device, steps, trace)
    finally:
        runner.graphs = graphs
    kernels = collect_kernels(events, device.type)
    num_layers = len(model.layers)
    row["gemm_labels"] = label_gemms(kernels, num_layers)
    row["profile_steps"] = steps
    row["eager_profile"] = summarize(kernels, steps)
    row["kernels_per_step"] = len(kernels) / steps
    row["kernel_sum_ms"] = sum(k.dur_us for k in kernels) / 1e3 / steps
    row["gap_ms"] = row["step_ms"] - row["kernel_sum_ms"]
    # The profiled steps' host time (what a CPU kernel sum must fit in; on a GPU, launch-bound).
    spans = [_span(e) for e in events if e.name == SCOPE_PREFIX + "step"]
    row["profiled_step_ms"] = sum(end - start for start, end in spans) / 1e3 / max(len(spans), 1)
    floors_ms = row["floor_by_category_ms"]
    excess = {
        key: row["eager_profile"].get(key, {}).get("ms", 0.0) - floors_ms.get(key, 0.0)
        for key in {*row["eager_profile"], *floors_ms}
    }
    excess["gaps"] = row["gap_ms"]
    row["excess_ms"] = dict(sorted(excess.items(), key=lambda item: -item[1]))
    row["gemms"] = gemm_rows(row, gemm_shapes(model, row["tokens"], step.logit_rows.shape[0]), bandwidth_gbs)
    if graphs is not None:
        trace = trace_dir / f"trace-b{batch}-w{window}-graph.json.gz" if trace_dir else None
        graph_kernels = collect_kernels(profile_calls(run, device, steps, trace), device.type)
        row["graph_kernels_visible"] = len(graph_kernels) / steps
        # Outside the graph the replay launches only the LM head, the argmax and a few copies: with
        # fewer than half the eager kernels, the profiler did not see inside the graph.
        if len(graph_kernels) >= len(kernels) / 2:
            row["graph_gemm_labels"] = label_gemms(graph_kernels, num_layers)
            row["graph_profile"] = summarize(graph_kernels, steps)
            row["graph_kernel_sum_ms"] = sum(k.dur_us for k in graph_kernels) / 1e3 / steps
            row["graph_gap_ms"] = row["graph_ms"] - row["graph_kernel_sum_ms"]
            for gemm in row["gemms"]:
                entry = row["graph_profile"].get(f"gemm:{gemm['projection']}")
                gemm["graph_us_per_call"] = entry["ms"] * 1e3 / gemm["calls"] if entry else None


def cache_element_size(cache: object) -> int:
    """Bytes per element of the KV cache."""
    k_cache, _ = cache.layer(0)
    return k_cache.element_size()


def gemm_rows(row: dict, shapes: Sequence[GemmShape], bandwidth_gbs: float) -> list[dict]:
    """Each projection's GEMM kernels in the eager profile: µs per call and the bandwidth it achieves."""
    rows = []
    for shape in shapes:
        entry = row["eager_profile"].get(f"gemm:{shape.projection}")
        if entry is None:
            continue
        us = entry["ms"] * 1e3 / shape.calls
        gbs = shape.bytes_per_call / (us * 1e-6) / 1e9 if us > 0 else float("nan")
        rows.append(
            {
                "projection": shape.projection,
                "m": shape.m,
                "n": shape.n,
                "k": shape.k,
                "calls": shape.calls,
                "kernels_per_call": entry["count"] / shape.calls,
                "bytes_per_call": shape.bytes_per_call,
                "us_per_call": us,
                "GBs": gbs,
                "of_copy_bandwidth": gbs / bandwidth_gbs,
                "kernel": next(iter(entry["names"]), ""),
            }
        )
    return rows


# The part ----------------------------------------------------------------------------------------------


def parse_configs(text: str) -> list[tuple[int, int]]:
    """Batch x window pairs from "1x1,8x1,64x1,1x8" (a bare number is a window of 1)."""
    configs = []
    for item in text.split(","):
        batch, _, window = item.strip().partition("x")
        configs.append((int(batch), int(window or 1)))
    return configs


def run_profile(
    runner: object,
    configs: Sequence[tuple[int, int]],
    make_step: Callable[[int, int], object],
    context: int,
    bandwidth_gbs: float,
    section: dict,
    errors: dict,
    save: Callable[[], None],
    repeats: int = 15,
    steps: int = 3,
    trace_dir: Path | None = None,
    deadline: float | None = None,
) -> None:
    """Time every config (section["configs"]), then F.linear alone at every projection shape and token
    count (section["linear_alone"]), then profile every config timed. Timings come first so that no
    profiler session (whose CUPTI hooks may stay behind) touches them, and they survive a profiler
    that breaks. Each piece is saved as it ends; a failing piece is recorded in `errors` and the next
    one runs; none starts past `deadline` (time.monotonic())."""
    device = runner.device
    dtype = next(runner.model.parameters()).dtype
    section.setdefault("configs", [])
    section.setdefault("linear_alone", [])
    if device.type == "cuda":
        # Several profiler sessions in a process that replays CUDA graphs: torch's own workaround for
        # crashes on re-initialising CUPTI after a teardown (torch/profiler/profiler.py) is to keep it.
        os.environ.setdefault("TEARDOWN_CUPTI", "0")

    def piece(name: str, body: Callable[[], None]) -> None:
        key = f"profile {name}"
        if deadline is not None and time.monotonic() > deadline:
            errors[key] = "skipped: --budget-s ran out"
            return
        started = time.perf_counter()
        try:
            body()
        except Exception:  # noqa: BLE001 - keep what the other pieces measure
            errors[key] = traceback.format_exc()
            print(errors[key], flush=True)
        print(f"{key}: {time.perf_counter() - started:.1f} s", flush=True)
        save()

    made: dict[tuple[int, int], tuple[object, dict]] = {}
    for batch, window in configs:

        def timing(batch: int = batch, window: int = window) -> None:
            step = make_step(batch, window)
            row = time_config(runner, step, batch, window, context, bandwidth_gbs, repeats)
            section["configs"].append(row)
            made[(batch, window)] = step, row
            print("profile", summary_line(row), flush=True)

        piece(f"b{batch}w{window} timing", timing)
    shapes = {}
    for batch, window in configs:
        for shape in gemm_shapes(runner.model, batch * window, batch * window):
            shapes[(shape.projection, shape.m)] = shape

    def alone() -> None:
        for shape in shapes.values():
            if deadline is not None and time.monotonic() > deadline:
                errors["profile linear_alone"] = "skipped the rest: --budget-s ran out"
                return
            section["linear_alone"].append(linear_alone(shape, device, dtype, bandwidth_gbs))
            if device.type == "cuda":
                torch.cuda.empty_cache()

    piece("linear_alone", alone)
    traced = False
    for (batch, window), (step, row) in made.items():
        # The trace: the first batch-1 config only (the next person's look at a decode step).
        trace = trace_dir if trace_dir is not None and batch == 1 and not traced else None
        traced = traced or trace is not None

        def profiled(step: object = step, row: dict = row, trace: Path | None = trace) -> None:
            profile_config(row, runner, step, bandwidth_gbs, steps, trace)
            print("profile", summary_line(row), flush=True)

        piece(f"b{batch}w{window} profile", profiled)


# Reporting ---------------------------------------------------------------------------------------------


def category_label(key: str, gemms: Sequence[dict]) -> str:
    """A category key as the table shows it: a GEMM with its shape."""
    base, _, projection = key.partition(":")
    if base != "gemm":
        return key
    shape = next((g for g in gemms if g["projection"] == projection), None)
    if shape is None:
        return f"gemm {projection}"
    return f"gemm {projection} (M={shape['m']}, N={shape['n']}, K={shape['k']})"


def summary_line(row: dict) -> str:
    """graph ms, floor ms, kernel-sum ms, gap ms and the three largest excess-over-floor contributors
    (the timings alone before the profile is in)."""
    step = "graph" if "graph_ms" in row else "eager step"
    line = (
        f"batch {row['batch']} window {row['window']}: {step} {row['step_ms']:.3f} ms, floor "
        f"{row['floor_ms']:.3f} ms ({row['step_vs_floor']:.2f}x)"
    )
    if "excess_ms" not in row:
        return line + f", eager {row['eager_ms']:.3f} ms; not profiled"
    contributors = ", ".join(f"{key} {ms:+.3f}" for key, ms in list(row["excess_ms"].items())[:3])
    return (
        line + f", kernel sum {row['kernel_sum_ms']:.3f} ms, gaps {row['gap_ms']:.3f} ms; largest excess "
        f"(ms): {contributors}"
    )


def _cell(name: str, width: int = 60) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= width else name[: width - 1] + "…"


def _alone(section: dict, projection: str, m: int) -> dict | None:
    rows = section.get("linear_alone", [])
    return next((a for a in rows if (a["projection"], a["m"]) == (projection, m)), None)


def markdown(section: dict) -> list[str]:
    """The profile part's markdown: a summary per config, its category and GEMM tables, and F.linear
    alone."""
    lines = [
        f"## Where a step's time goes ({section.get('shape', '?')} shape, {section.get('dtype', '?')}, "
        f"{section.get('context', '?')} cached tokens a request, on {section.get('device', '?')})",
        "",
        f"Copy bandwidth {section.get('copy_bandwidth_GBs', float('nan')):.0f} GB/s (read + write). A "
        "step is forward + argmax; kernel times are per step from the eager profile; the floor is "
        "weights + attended KV over the copy bandwidth, split by the category that reads them; gaps = "
        "step time - kernel sum.",
        "",
    ]
    for row in section.get("configs", []):
        lines += [f"### {summary_line(row)}", ""]
        if "excess_ms" not in row:
            continue
        graph = row.get("graph_profile")
        visible = row.get("graph_kernels_visible")
        if visible is not None:
            lines += [
                f"Graph replay profiled: {visible:.0f} kernels a step visible"
                + (
                    f", kernel sum {row['graph_kernel_sum_ms']:.3f} ms, gaps {row['graph_gap_ms']:.3f} ms "
                    f"(GEMMs labelled by {row['graph_gemm_labels']})."
                    if graph
                    else " (the profiler does not see inside the graph here)."
                ),
                "",
            ]
        lines += [
            f"| category | kernels/step | eager ms | {'graph ms | ' if graph else ''}floor ms | excess ms "
            "| main kernel |",
            "|---|---:|---:|" + ("---:|" if graph else "") + "---:|---:|---|",
        ]
        floors = row["floor_by_category_ms"]
        keys = sorted({*row["eager_profile"], *(graph or {}), *floors}, key=category_rank)
        for key in keys:
            entry = row["eager_profile"].get(key, {"count": 0, "ms": 0.0, "names": {}})
            graph_cell = f"{graph.get(key, {}).get('ms', 0.0):.3f} | " if graph else ""
            lines.append(
                f"| {category_label(key, row['gemms'])} | {entry['count']:.0f} | {entry['ms']:.3f} | "
                f"{graph_cell}{floors.get(key, 0.0):.3f} | {row['excess_ms'].get(key, 0.0):+.3f} | "
                f"{_cell(next(iter(entry['names']), ''))} |"
            )
        graph_gap = f"{row['graph_gap_ms']:.3f} | " if graph else ""
        lines += [
            f"| gaps (step - kernel sum) | | {row['gap_ms']:.3f} | {graph_gap}0 | {row['gap_ms']:+.3f} | |",
            f"| **step ({row['step_timing']})** | | **{row['step_ms']:.3f}** | "
            f"{'**{:.3f}** | '.format(row['step_ms']) if graph else ''}**{row['floor_ms']:.3f}** | "
            f"**{row['step_ms'] - row['floor_ms']:+.3f}** | |",
            "",
            f"GEMMs (projection labels by {row['gemm_labels']}); bytes = weights + input + output; alone = "
            "F.linear replayed by itself at the same shape.",
            "",
            "| projection | M | N | K | calls | µs/call | "
            + ("graph µs/call | " if graph else "")
            + "MB/call | GB/s | of copy | alone µs | alone GB/s | alone of copy | kernel |",
            "|---|---:|---:|---:|---:|---:|"
            + ("---:|" if graph else "")
            + "---:|---:|---:|---:|---:|---:|---|",
        ]
        for g in row["gemms"]:
            alone = _alone(section, g["projection"], g["m"])
            alone_cells = (
                f"{alone['us_per_call']:.1f} | {alone['GBs']:.0f} | {alone['of_copy_bandwidth']:.2f}"
                if alone
                else "– | – | –"
            )
            in_graph = g.get("graph_us_per_call")
            graph_cell = (f"{in_graph:.1f} | " if in_graph is not None else "– | ") if graph else ""
            lines.append(
                f"| {g['projection']} | {g['m']} | {g['n']} | {g['k']} | {g['calls']} "
                f"| {g['us_per_call']:.1f} | {graph_cell}{g['bytes_per_call'] / 1e6:.2f} | {g['GBs']:.0f} "
                f"| {g['of_copy_bandwidth']:.2f} | {alone_cells} | {_cell(g['kernel'], 50)} |"
            )
        lines.append("")
    alone_rows = section.get("linear_alone", [])
    if alone_rows:
        ms = sorted({a["m"] for a in alone_rows})
        lines += [
            "### F.linear alone (µs per call, GB/s, share of the copy bandwidth)",
            "",
            "| projection | N | K | " + " | ".join(f"M={m}" for m in ms) + " |",
            "|---|---:|---:|" + "---:|" * len(ms),
        ]
        for projection in PROJECTIONS:
            first = next((a for a in alone_rows if a["projection"] == projection), None)
            if first is None:
                continue
            cells = []
            for m in ms:
                a = _alone(section, projection, m)
                cells.append(
                    f"{a['us_per_call']:.1f} µs, {a['GBs']:.0f}, {a['of_copy_bandwidth']:.2f}" if a else ""
                )
            lines.append(f"| {projection} | {first['n']} | {first['k']} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines
