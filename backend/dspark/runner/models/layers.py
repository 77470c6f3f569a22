"""Tensor-parallel-ready layers: column/row-parallel linears, vocabulary-parallel embedding and head,
RMSNorm and rotary embedding. Each parameter carries a `load` that takes the full checkpoint tensor
and keeps this rank's shard, so the loader never needs to know how a layer is split.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels import ops
from dspark.kernels.cpu import linear as cpu_linear
from dspark.parallel.distributed import SINGLE, TensorParallel
from dspark.runner.models.measured_paths import MeasuredPaths, default_file

Loader = Callable[[torch.Tensor, torch.Tensor, str | None], None]


# Rows up to which a CPU linear takes the path measured for its row count (see `linear`); more rows (a
# prefill chunk) take the path measured at MANY_ROWS.
CPU_FEW_ROWS = 16
MANY_ROWS = 64
# A path this much slower than the best in a round is not timed again (measure_cpu_linear_paths).
CLEAR_LOSS = 1.3
# Another path is taken over F.linear only if it takes at most this share of F.linear's time.
CLEAR_WIN = 0.9

# The ways `linear` may compute rows on a CPU (`CpuLinearPaths`).
BY_LINEAR = "linear"  # F.linear (x W^T; one row: a GEMV)
WEIGHT_FIRST = "weight_first"  # (W x^T)^T: the weight as the long operand
AS_TWO_ROWS = "as_two_rows"  # one row only: W x^T of the row taken twice
# MKL's packed GEMM over a copy of the weight reordered once (`pack_cpu_weights`): past MKL's small-M
# cliff (4+ rows) it ran a pass 1.45-2.1x faster than F.linear on an Intel Xeon, where a row's result
# did not depend on the rows beside it (F.linear's does from 2 rows on; on an AMD EPYC the packed
# product's do too, by a few units in the last place, from 4 rows on).
PACKED = "packed"
# oneDNN's product over a copy of the weight reordered once into its blocked layout (what torch's
# compiler uses for frozen CPU linears): on a 2-core AMD EPYC a pass over SmolLM2's weights took
# 0.65-0.7x the best other path's time at 1-4 rows and 0.3-0.4x F.linear's at 16-128 rows (prefill),
# and each row's result was the same bits whatever rows were beside it.
ONEDNN = "onednn"
# The paths over a packed copy: the attribute each copy is kept in on its weight, and the copies'
# bytes over the weight's (measured on SmolLM2's shapes: MKL's 2.06-2.29x, oneDNN's 1x; with room).
COPY_ATTRIBUTE = {ONEDNN: "onednn_packed", PACKED: "mkl_packed"}
COPY_SIZE = {ONEDNN: 1.1, PACKED: 2.5}
# The weight dtypes each packed path takes: oneDNN's bf16 product accumulates in fp32 and, on a 2-core
# AMD EPYC with AVX512-BF16, ran a pass over SmolLM2's weights in 8.5-10.3 ms at 1-8 rows (fp32's:
# 18.5-24 ms; bf16 F.linear's 12-14 ms; two runs).
PACKED_DTYPES = {ONEDNN: (torch.float32, torch.bfloat16), PACKED: (torch.float32,)}
# The CPU kernel (`dspark.kernels.cpu.linear`, built on this machine where it can be): fp32, no gradients,
# no copy. Each output is one sum in one order whatever rows are beside it, and it takes every row count
# or none (`_kernel_takes_all`): a row's bits then never depend on the step it runs in (one request alone,
# a verify window, a batch, a prefill chunk beside it), so speculative greedy output equals plain decoding's
# by construction, not only where no near-tie meets a different sum. On a 2-core AMD EPYC without AVX-512
# a pass over SmolLM2's weights took 17.6 / 19.9 / 119 ms at 1 / 4 / 64 rows against oneDNN's 21.6 /
# 30.0 / 128 (session 56).
KERNEL = "kernel"
# The kernel is taken if over the few-row counts together it is no slower than the fastest other paths
# (its one order of sums is what makes fp32 speculation exact, so a tie goes to it), at one row (plain
# decoding's shape) it ties at worst (ONE_ROW_TOLERANCE), and at no row count measured takes more than
# this share of the fastest other path's time (a prefill chunk's included): a clear loss, not noise.
# All or nothing, the choice must not flip with the host's spells: a pass varies by 10-40% between rounds
# on a shared host, and at 1.15 one measurement in four (session 56, this 2-core EPYC) turned the kernel
# off everywhere, decoding then 1.4x slower.
KERNEL_TOLERANCE = 1.5
# At one row a tie within the host's noise: on a 2-core Xeon with AVX-512 (session 58) the kernel read a
# pass of SmolLM2 at one row in 0.86-0.96x the best library path's time (the memory's bandwidth bounds
# both) and at 4-16 rows in 0.6-0.9x; asked to win by 10% at one row, it would be taken in some starts
# and not in others.
ONE_ROW_TOLERANCE = 1.1
CANDIDATES = {1: (BY_LINEAR, AS_TWO_ROWS)}  # by row count; the rest: (BY_LINEAR, WEIGHT_FIRST)
# The packed copies may take at most this share of the memory available when they are made.
PACKED_MEMORY_SHARE = 0.25


def candidates(rows: int, packed: Sequence[str] = ()) -> tuple[str, ...]:
    """The paths measured for this many rows (`packed`: the paths whose copies the weights have)."""
    unpacked = (BY_LINEAR,) if rows > CPU_FEW_ROWS else CANDIDATES.get(rows, (BY_LINEAR, WEIGHT_FIRST))
    return unpacked + tuple(packed)


@dataclass
class CpuLinearPaths:
    """How `linear` computes rows on a CPU: a path per row count up to CPU_FEW_ROWS (`by_rows[rows -
    1]`), one for more rows (`many_rows`), and for a weight without the copy its path needs (a slice of
    a weight, a module measured apart; or an input that needs gradients) the fastest path without one
    (`unpacked_by_rows`, `unpacked_many_rows`).

    Which is faster depends on the host's BLAS and cache, not on the model, and differs by row count:
    on a 2-core AMD EPYC, F.linear read the SmolLM2 target's weights at a third of the speed of W x^T
    for one row and for 2-16 rows; on a 2-core Intel Xeon with MKL 2024, W x^T ran a whole pass of 2-3
    rows at 2.3x the time of F.linear, and F.linear itself costs 1.1x one row for 2-3 rows and 1.9x
    for 4 (a verify window of a block of 3); so `measure_cpu_linear_paths` times them over a model's
    own weights when it is loaded. Until then: the EPYC's unpacked choice. Where torch has oneDNN or
    MKL's packed GEMM the weights get packed copies and those paths (`ONEDNN`, `PACKED`) are measured
    too: on the Xeon MKL's tied F.linear at 1-3 rows and ran 4-15 rows in 0.6-0.84x its time (past
    MKL's small-row cliff).
    """

    by_rows: tuple[str, ...] = (AS_TWO_ROWS,) + (WEIGHT_FIRST,) * (CPU_FEW_ROWS - 1)
    many_rows: str = BY_LINEAR
    unpacked_by_rows: tuple[str, ...] = (AS_TWO_ROWS,) + (WEIGHT_FIRST,) * (CPU_FEW_ROWS - 1)
    unpacked_many_rows: str = BY_LINEAR

    def path(self, rows: int) -> str:
        """The path for this many rows (1 or more)."""
        return self.by_rows[rows - 1] if rows <= CPU_FEW_ROWS else self.many_rows

    def unpacked_path(self, rows: int) -> str:
        """The path for this many rows of a weight without the copy `path(rows)` needs."""
        return self.unpacked_by_rows[rows - 1] if rows <= CPU_FEW_ROWS else self.unpacked_many_rows

    def describe(self) -> str:
        """One line: each row count's path, then the many rows' one."""
        few = " ".join(f"{rows}:{path}" for rows, path in enumerate(self.by_rows, 1))
        return f"{few} {CPU_FEW_ROWS + 1}+:{self.many_rows}"


# The choice for fp32 weights; each other dtype's is measured on its own (`cpu_linear_paths`): which
# path wins differs by dtype (bf16 has no MKL packing; its oneDNN product is twice fp32's speed).
CPU_LINEAR_PATHS = CpuLinearPaths()
_PATHS_BY_DTYPE: dict[torch.dtype, CpuLinearPaths] = {torch.float32: CPU_LINEAR_PATHS}


def cpu_linear_paths(dtype: torch.dtype) -> CpuLinearPaths:
    """The paths `linear` takes for CPU weights of `dtype` (the unmeasured default until a model of
    that dtype is loaded)."""
    paths = _PATHS_BY_DTYPE.get(dtype)
    if paths is None:
        paths = _PATHS_BY_DTYPE[dtype] = CpuLinearPaths()
    return paths


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed on a CPU by the path measured fastest for its row count and the weight's
    dtype (`cpu_linear_paths`) and by the skinny-product kernel for a few rows on a GPU
    (`ops.few_rows_linear`). Other shapes: F.linear."""
    rows = _num_rows(x)
    if x.device.type != "cpu":
        # ops decides which products the kernel takes (rows, dtype, width); the rest go to F.linear.
        return F.linear(x, weight, bias) if bias is not None else ops.few_rows_linear(x, weight)
    if rows == 0:
        return F.linear(x, weight, bias)
    path = _cpu_path(x, weight, rows)
    if path == BY_LINEAR:
        return F.linear(x, weight, bias)
    y = _product(x.reshape(rows, x.shape[-1]), weight, path)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _cpu_path(x: torch.Tensor, weight: torch.Tensor, rows: int) -> str:
    """The path `linear` takes for `rows` rows of CPU x times weight: the measured choice, or the unpacked
    one where it cannot run (no packed copy; gradients wanted; the kernel's fp32 only)."""
    paths = cpu_linear_paths(weight.dtype)
    path = paths.path(rows)
    if path in COPY_ATTRIBUTE and (x.requires_grad or getattr(weight, COPY_ATTRIBUTE[path], None) is None):
        # No copy to read (or gradients wanted, which the packed products do not give).
        return paths.unpacked_path(rows)
    if path == KERNEL and (
        (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or x.dtype != torch.float32
    ):
        # The kernel has no backward, and takes fp32 only (only fp32 weights' choices hold it).
        return paths.unpacked_path(rows)
    return path


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x times a [gate; up] weight, without a bias: on a CPU in the kernel's epilogue
    where `linear` takes the kernel for these rows (its products, summed the same way), on a GPU in the
    skinny-product kernel's where `ops.silu_mul_linear` can; else the product, then `ops.silu_mul`."""
    if x.device.type != "cpu":
        return ops.silu_mul_linear(x, weight)
    rows = _num_rows(x)
    if rows and _cpu_path(x, weight, rows) == KERNEL:
        y = _kernel_call("silu_mul_rows", x.reshape(rows, x.shape[-1]), weight)
        return y.reshape(*x.shape[:-1], weight.shape[0] // 2)
    return ops.silu_mul(linear(x, weight))


def _num_rows(x: torch.Tensor) -> int:
    """The rows of x [..., in] a product multiplies (0 for an empty input)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _kernel_call(name: str, flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The CPU kernel's `name` (`linear_rows`, `silu_mul_rows`) of flat [rows, in] and weight, contiguous;
    named `cpu_kernel::<name>` in a profile (an extension's call is no ATen op; the process-wide flag,
    since a step may run on another thread than the one that started the profiler)."""
    kernel = getattr(cpu_linear, name)
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(f"cpu_kernel::{name}"):
            return kernel(flat.contiguous(), weight.contiguous())
    return kernel(flat.contiguous(), weight.contiguous())


def _product(flat: torch.Tensor, weight: torch.Tensor, path: str) -> torch.Tensor:
    """flat [rows, in] @ weight^T by `path`: [rows, out], contiguous (a packed path of a weight without
    its copy: F.linear)."""
    if path == BY_LINEAR:
        return F.linear(flat, weight)
    if path == AS_TWO_ROWS:
        return torch.mm(weight, flat.repeat(2, 1).t())[:, :1].t().contiguous()
    if path == KERNEL:
        return _kernel_call("linear_rows", flat, weight)
    if path in COPY_ATTRIBUTE:
        copy = getattr(weight, COPY_ATTRIBUTE[path], None)
        if copy is None:
            return F.linear(flat, weight)
        if path == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(flat, copy, None, "none", [], "")
        return torch.ops.mkl._mkl_linear(flat, copy, weight, None, flat.shape[0])
    return torch.mm(weight, flat.t()).t().contiguous()


def packs_on_this_cpu(path: str = PACKED) -> bool:
    """Whether this torch has the packed product of `path` (MKL's packed GEMM, oneDNN's linear)."""
    try:
        if path == ONEDNN:
            return torch.backends.mkldnn.is_available() and all(
                hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight")
            )
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def available_memory_bytes() -> int:
    """Physical memory available now (Linux: the kernel's free pages; 0 where it cannot say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def pack_cpu_weights(weights: Sequence[torch.Tensor], path: str = PACKED) -> bool:
    """Give each weight a packed copy for `path` (`COPY_ATTRIBUTE`), if this CPU has that product, it
    takes their dtype (`PACKED_DTYPES`; one dtype for all) and the copies fit PACKED_MEMORY_SHARE of
    the available memory; whether it did."""
    if not weights or not packs_on_this_cpu(path):
        return False
    dtype = weights[0].dtype
    if dtype not in PACKED_DTYPES[path] or any(w.dtype != dtype for w in weights):
        return False
    needed = COPY_SIZE[path] * sum(w.numel() * w.element_size() for w in weights)
    if needed > PACKED_MEMORY_SHARE * available_memory_bytes():
        return False
    # One packing serves every row count (the row count given here is only the library's hint).
    if path == ONEDNN:
        reorder = torch.ops.mkldnn._reorder_linear_weight
    else:
        reorder = torch.ops.mkl._mkl_reorder_linear_weight
    try:
        for w in weights:
            setattr(w, COPY_ATTRIBUTE[path], reorder(w.detach(), 4))
        # One product over a copy: a build that packs but cannot multiply fails here, at load, not in
        # a step.
        _product(torch.zeros(1, weights[0].shape[1], dtype=dtype), weights[0], path)
    except RuntimeError:
        unpack_cpu_weights(weights, path)
        return False
    return True


def unpack_cpu_weights(weights: Sequence[torch.Tensor], path: str = PACKED) -> None:
    """Drop the packed copies of `path` (no row count took it)."""
    for w in weights:
        if hasattr(w, COPY_ATTRIBUTE[path]):
            delattr(w, COPY_ATTRIBUTE[path])


def pack_like_measured(weights: Sequence[torch.Tensor]) -> None:
    """Give CPU `weights` measured apart from the model (a drafter's) the copies of the packed paths
    their dtype's choice (`cpu_linear_paths`) takes, where they fit."""
    weights = [w for w in weights if w.dim() == 2 and w.device.type == "cpu"]
    with torch.inference_mode():
        for dtype in {w.dtype for w in weights}:
            alike = [w for w in weights if w.dtype == dtype]
            for path in _packed_paths(cpu_linear_paths(dtype)):  # a weight shared with the model has its copy
                pack_cpu_weights([w for w in alike if not hasattr(w, COPY_ATTRIBUTE[path])], path)


# measure_cpu_linear_paths' choices: this process's and the machine's file (`measured_paths`).
MEASURED = MeasuredPaths(default_file)


def measure_cpu_linear_paths(module: nn.Module, rounds: int = 2) -> CpuLinearPaths:
    """Time each row count's candidate paths over every 2-D weight of `module` (a whole pass, in
    order, so that weights come from memory as in a step; one dtype, the first weight's, is measured),
    1..CPU_FEW_ROWS and MANY_ROWS, keep the fastest per row count as that dtype's choice
    (`cpu_linear_paths`) and return it (F.linear unless another path
    clearly wins: CLEAR_WIN). Only candidates within CLEAR_LOSS of the best are timed again; weights of
    the same shapes measured before on this machine (`MEASURED`: in this process or an earlier one)
    take that choice (its packed copies made again where they fit, else the fastest unpacked path).
    fp32 weights also time the CPU kernel where it runs here (`kernel_here`), taken for every row count
    or none (`_kernel_takes_all`; the packed copies are then dropped). A no-op returning the current
    choice off the CPU."""
    weights = [p for p in module.parameters() if p.dim() == 2 and p.device.type == "cpu"]
    if not weights:
        return CPU_LINEAR_PATHS
    current = cpu_linear_paths(weights[0].dtype)
    weights = [w for w in weights if w.dtype == weights[0].dtype]
    kernel = (KERNEL,) if weights[0].dtype == torch.float32 and kernel_here() else ()
    key = MEASURED.key(
        tuple((tuple(w.shape), w.dtype) for w in weights), cpu_linear.build_id() if kernel else None
    )
    known = _stored_paths(MEASURED.get(key), kernel)
    with torch.inference_mode():
        wanted = tuple(COPY_ATTRIBUTE) if known is None else _packed_paths(known)
        packed = tuple(path for path in wanted if pack_cpu_weights(weights, path))
        if known is None:
            known = _measure(weights, rounds, packed, kernel)
            MEASURED.put(key, asdict(known))
        chosen = _without(known, set(wanted) - set(packed))  # the copies that no longer fit
    for path in set(packed) - set(_packed_paths(chosen)):
        unpack_cpu_weights(weights, path)
    for choice in fields(CpuLinearPaths):  # in place: `linear` reads this one object
        setattr(current, choice.name, getattr(chosen, choice.name))
    return current


def _stored_paths(stored: dict | None, kernel: tuple[str, ...]) -> CpuLinearPaths | None:
    """A stored choice as `CpuLinearPaths`; None where there is none, or it names a path unknown here
    or the kernel where it is not measured (a file from another version: measured again)."""
    if stored is None:
        return None
    known = {BY_LINEAR, WEIGHT_FIRST, AS_TWO_ROWS, *COPY_ATTRIBUTE, *kernel}
    try:
        paths = CpuLinearPaths(
            tuple(stored["by_rows"]),
            stored["many_rows"],
            tuple(stored["unpacked_by_rows"]),
            stored["unpacked_many_rows"],
        )
    except (KeyError, TypeError):
        return None
    every = (*paths.by_rows, paths.many_rows, *paths.unpacked_by_rows, paths.unpacked_many_rows)
    if len(paths.by_rows) != CPU_FEW_ROWS or len(paths.unpacked_by_rows) != CPU_FEW_ROWS:
        return None
    return paths if all(isinstance(path, str) and path in known for path in every) else None


def _packed_paths(paths: CpuLinearPaths) -> tuple[str, ...]:
    """The packed paths `paths` takes anywhere."""
    return tuple(path for path in COPY_ATTRIBUTE if path in (*paths.by_rows, paths.many_rows))


def _without(paths: CpuLinearPaths, missing: set[str]) -> CpuLinearPaths:
    """`paths` with the packed paths in `missing` (no copies) replaced by the unpacked choice."""
    if not missing:
        return paths
    few = tuple(
        unpacked if path in missing else path
        for path, unpacked in zip(paths.by_rows, paths.unpacked_by_rows, strict=True)
    )
    many = paths.unpacked_many_rows if paths.many_rows in missing else paths.many_rows
    return CpuLinearPaths(few, many, paths.unpacked_by_rows, paths.unpacked_many_rows)


def kernel_here() -> bool:
    """Whether the CPU kernel runs on this machine (built on the first ask)."""
    return cpu_linear.available()


def _measure(
    weights: list[torch.Tensor], rounds: int, packed: tuple[str, ...], kernel: tuple[str, ...] = ()
) -> CpuLinearPaths:
    """Every row count's fastest path, and fastest unpacked path, over `weights` (`kernel`: (KERNEL,)
    to time the kernel too, then taken for every row count or none: `_kernel_takes_all`)."""
    # One more round where the kernel's choice is decided (one row, a prefill chunk): a pass is the best
    # of its rounds, and one clean round is all it takes.
    extra = 1 if kernel else 0
    few = [
        _fastest(weights, rows, rounds + (extra if rows == 1 else 0), packed + kernel)
        for rows in range(1, CPU_FEW_ROWS + 1)
    ]
    many = _fastest(weights, MANY_ROWS, rounds + extra, packed + kernel)
    unpacked_by_rows = tuple(unpacked for _, unpacked, _ in few)
    if kernel and _kernel_takes_all([times for _, _, times in (*few, many)]):
        return CpuLinearPaths((KERNEL,) * CPU_FEW_ROWS, KERNEL, unpacked_by_rows, many[1])
    without = [_clear_winner(times, set(times) - {KERNEL}) for _, _, times in (*few, many)]
    return CpuLinearPaths(tuple(without[:-1]), without[-1], unpacked_by_rows, many[1])


def _kernel_takes_all(times_by_count: list[dict[str, float]]) -> bool:
    """Whether the kernel takes every row count: over the few-row counts (every entry but the last, a
    prefill chunk's) together it takes no more than the fastest other paths' summed times, at one row
    (the first entry) at most ONE_ROW_TOLERANCE of the fastest other path's time, and at every count
    within KERNEL_TOLERANCE. All or nothing, never a range of counts: with the kernel for
    some counts and a library product for others, a row's bits would depend on how many rows its step
    has, and a verify window could then differ from plain decoding on a near-tie."""
    if not times_by_count:
        return False
    best_others = [min(t for path, t in times.items() if path != KERNEL) for times in times_by_count]
    for index, (times, others) in enumerate(zip(times_by_count, best_others, strict=True)):
        if times[KERNEL] > (ONE_ROW_TOLERANCE if index == 0 else KERNEL_TOLERANCE) * others:
            return False
    few = times_by_count[:-1] or times_by_count
    return sum(times[KERNEL] for times in few) <= sum(best_others[: len(few)])


def pass_inputs(weights: list[torch.Tensor], rows: int) -> dict[int, torch.Tensor]:
    """Random inputs of `rows` rows for every input width among `weights` (`pass_seconds`)."""
    return {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}


def pass_seconds(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], path: str) -> float:
    """Seconds for one pass of `inputs` (`pass_inputs`) through every weight, in order, by `path`."""
    start = time.perf_counter()
    for w in weights:
        _product(inputs[w.shape[1]], w, path)
    return time.perf_counter() - start


def _fastest(
    weights: list[torch.Tensor], rows: int, rounds: int, packed: Sequence[str] = ()
) -> tuple[str, str, dict[str, float]]:
    """The candidate path of `rows` rows that takes least time over `weights` (`packed`: the packed
    paths whose copies they have, and KERNEL if it is to be timed), the fastest of the unpacked ones,
    and every candidate's best pass time."""
    inputs = pass_inputs(weights, rows)
    best = dict.fromkeys(candidates(rows, packed), math.inf)
    timing = set(best)
    for _ in range(rounds):
        for path in timing:  # alternated: a slow spell of the host falls on all of them
            best[path] = min(best[path], pass_seconds(weights, inputs, path))
        fastest = min(best.values())
        # The kernel is timed every round: its choice is all or nothing (`_kernel_takes_all`), and one
        # slow round must not stand as its time.
        timing = {path for path in timing if best[path] <= CLEAR_LOSS * fastest or path == KERNEL}
        if len(timing) == 1:
            break
    return _clear_winner(best, timing), _clear_winner(best, set(candidates(rows))), best


def _clear_winner(best: dict[str, float], among: set[str]) -> str:
    """The fastest path `among` those timed, but F.linear unless it clearly wins (CLEAR_WIN): near a
    tie the choice would move between runs with the host's noise (at one row the packed path tied
    F.linear on the Xeon and then ran a decode step up to 10% slower in some rounds), and each path
    rounds its sums its own way."""
    fastest = min(among, key=best.__getitem__)
    if BY_LINEAR in among and best[fastest] > CLEAR_WIN * best[BY_LINEAR]:
        return BY_LINEAR
    return fastest


def _attach(param: nn.Parameter, load: Loader) -> nn.Parameter:
    param.load = load  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split over ranks; outputs stay sharded.

    `output_sizes` names the fused pieces (q, k, v or gate, up); each piece is split on its own
    so that a fused weight's shard holds this rank's part of every piece.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp: TensorParallel = SINGLE,
        shard_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.local_sizes = [tp.shard(s, "linear output size") for s in output_sizes]
        self.shard_names = list(shard_names) if shard_names else [None]
        out = sum(self.local_sizes)
        self.weight = _attach(nn.Parameter(torch.empty(out, input_size), requires_grad=False), self._load)
        self.bias = _attach(nn.Parameter(torch.empty(out), requires_grad=False), self._load) if bias else None

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_name: str | None) -> None:
        index = self.shard_names.index(shard_name)
        offset = sum(self.local_sizes[:index])
        size = self.local_sizes[index]
        piece = full.narrow(0, self.tp.rank * size, size)
        param.data.narrow(0, offset, size).copy_(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, input] -> [num_tokens, local output]."""
        return linear(x, self.weight, self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate, up] projection's forward(x): [num_tokens, local output / 2]; the
        activation runs in the product's kernel where one takes it (`silu_mul_linear`)."""
        if self.bias is not None:
            return ops.silu_mul(self.forward(x))
        return silu_mul_linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.local_input = tp.shard(input_size, "linear input size")
        self.weight = _attach(
            nn.Parameter(torch.empty(output_size, self.local_input), requires_grad=False), self._load
        )
        self.bias = (
            _attach(nn.Parameter(torch.empty(output_size), requires_grad=False), _copy) if bias else None
        )

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_name: str | None) -> None:
        param.data.copy_(full.narrow(1, self.tp.rank * self.local_input, self.local_input))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, local input] -> [num_tokens, output], summed over ranks."""
        y = linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split into contiguous per-rank ranges."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = math.ceil(vocab_size / tp.size)
        self.vocab_start = tp.rank * self.local_vocab
        self.weight = _attach(
            nn.Parameter(torch.zeros(self.local_vocab, hidden_size), requires_grad=False), self._load
        )

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_name: str | None) -> None:
        rows = full[self.vocab_start : self.vocab_start + self.local_vocab]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden]."""
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight) * inside[:, None]
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocabulary-parallel output projection; logits are gathered where sampling needs them."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.tp = embedding.tp
        self.vocab_size = embedding.vocab_size
        if tied:
            self.weight = embedding.weight
        else:
            self.weight = _attach(
                nn.Parameter(torch.zeros_like(embedding.weight), requires_grad=False), embedding._load
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, vocab] full logits on every rank."""
        logits = self.tp.all_gather_last_dim(linear(hidden, self.weight))
        return logits[:, : self.vocab_size]


class RMSNorm(nn.Module):
    """Root-mean-square norm; `forward(x, residual)` fuses the residual add."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _attach(nn.Parameter(torch.ones(size), requires_grad=False), _copy)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x, residual: [num_tokens, size] -> (normed, x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def _copy(param: torch.Tensor, full: torch.Tensor, shard_name: str | None) -> None:
    param.data.copy_(full)


def rotary_cos_sin(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """cos/sin table [max_positions, head_dim] (cos for the first half, sin for the second), fp32.

    Supports plain RoPE and the `llama3` frequency scaling of Llama 3.1+ checkpoints.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
