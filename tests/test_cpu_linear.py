"""`layers.linear`: every CPU path of every row count gives F.linear's result on random inputs; the
paths are measured per row count and taken; a weight without the packed copy its path reads, or an input
that wants gradients, takes the fastest unpacked path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from dspark.runner.models import layers
from dspark.runner.models.layers import (
    AS_TWO_ROWS,
    BY_LINEAR,
    CPU_FEW_ROWS,
    CPU_LINEAR_PATHS,
    MANY_ROWS,
    ONEDNN,
    PACKED,
    WEIGHT_FIRST,
    candidates,
    linear,
    measure_cpu_linear_paths,
    pack_cpu_weights,
    pack_like_measured,
    packs_on_this_cpu,
)
from dspark.runner.models.measured_paths import MeasuredPaths

# MKL's packed GEMM and oneDNN are in every x86 CPU build of torch (this project's machines and CI):
# their tests run.
needs_mkl = pytest.mark.skipif(not packs_on_this_cpu(PACKED), reason="this torch has no MKL packed GEMM")
needs_onednn = pytest.mark.skipif(not packs_on_this_cpu(ONEDNN), reason="this torch has no oneDNN")
PACKED_PATHS = [pytest.param(PACKED, marks=needs_mkl), pytest.param(ONEDNN, marks=needs_onednn)]


def _onednn_takes_bf16() -> bool:
    """Whether this CPU's oneDNN reorders a bf16 weight (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; a
    2-core AMD EPYC without AVX-512 has neither): the library's own answer, asked directly."""
    if not packs_on_this_cpu(ONEDNN):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 4)
    except RuntimeError:
        return False
    return True


needs_onednn_bf16 = pytest.mark.skipif(
    not _onednn_takes_bf16(), reason="this CPU's oneDNN has no bf16 product"
)
FIELDS = ("by_rows", "many_rows", "unpacked_by_rows", "unpacked_many_rows")


def _every_row_count(path_of: dict[int, str]) -> tuple[str, ...]:
    return tuple(path_of.get(rows, BY_LINEAR) for rows in range(1, CPU_FEW_ROWS + 1))


def _keep_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU_LINEAR_PATHS, the other dtypes' choices and the measured choices are put back after the test."""
    for name in FIELDS:
        monkeypatch.setattr(CPU_LINEAR_PATHS, name, getattr(CPU_LINEAR_PATHS, name))
    monkeypatch.setattr(layers, "_PATHS_BY_DTYPE", {torch.float32: CPU_LINEAR_PATHS})
    monkeypatch.setattr(layers, "MEASURED", MeasuredPaths())
    # The few-row kernel's measurement has tests of its own (test_cpu_kernel_linear.py).
    monkeypatch.setattr(layers, "kernel_here", lambda: False)


def _take(monkeypatch: pytest.MonkeyPatch, rows: int, path: str) -> None:
    """`linear` takes `path` for `rows` rows (F.linear for the others)."""
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", _every_row_count({rows: path}))
    monkeypatch.setattr(CPU_LINEAR_PATHS, "many_rows", path if rows > CPU_FEW_ROWS else BY_LINEAR)


def _packed_paths_here() -> tuple[str, ...]:
    return tuple(path for path in layers.COPY_ATTRIBUTE if packs_on_this_cpu(path))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, CPU_FEW_ROWS, CPU_FEW_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path of every row count around the thresholds, with and without bias, 2-D and 3-D inputs:
    F.linear's values, shape, contiguous."""
    _keep_paths(monkeypatch)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    in_features, out_features = 64, 96
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    packed = [path for path in _packed_paths_here() if pack_cpu_weights([weight], path)]
    assert packed == list(_packed_paths_here())
    for path in candidates(rows, packed):
        _take(monkeypatch, rows, path)
        for x in (
            torch.randn(rows, in_features, generator=gen),
            torch.randn(1, rows, in_features, generator=gen),
        ):
            got = linear(x, weight, b)
            assert got.shape == (*x.shape[:-1], out_features) and got.is_contiguous(), path
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_the_paths_are_measured_per_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_cpu_linear_paths keeps whichever path timed faster over the module's weights, for each
    row count: made slower F.linear loses everywhere it has a rival, made slower mm wins nowhere; the
    choice is what `linear` takes; a module of the same shapes takes the earlier choice without timing
    again."""
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    real_mm, real_linear = torch.mm, F.linear
    calls = {"mm": 0}

    def slow(fn, count: str | None = None):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if count:
                calls[count] += 1
            # Longer than the host's stalls under load: a round in which the path it slows is
            # descheduled longer than this is dropped from the timing for good (make test beside a
            # benchmark on the 2-core CI machine chose F.linear at 15 rows with 10 ms).
            time.sleep(0.05)
            return fn(*args, **kwargs)

        return wrapped

    _keep_paths(monkeypatch)
    monkeypatch.setattr(layers, "packs_on_this_cpu", lambda path=PACKED: False)  # packed: own tests
    monkeypatch.setattr(layers.F, "linear", slow(real_linear))
    chosen = measure_cpu_linear_paths(module)
    unpacked = (AS_TWO_ROWS,) + (WEIGHT_FIRST,) * (CPU_FEW_ROWS - 1)
    assert chosen is CPU_LINEAR_PATHS and chosen.by_rows == chosen.unpacked_by_rows == unpacked
    assert chosen.many_rows == BY_LINEAR  # no rival without packed copies

    monkeypatch.setattr(layers, "MEASURED", MeasuredPaths())
    monkeypatch.setattr(layers.F, "linear", real_linear)
    monkeypatch.setattr(layers.torch, "mm", slow(real_mm, "mm"))
    assert measure_cpu_linear_paths(module).by_rows == (BY_LINEAR,) * CPU_FEW_ROWS
    timed = calls["mm"]
    assert timed > 0
    same_shapes = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    assert measure_cpu_linear_paths(same_shapes).by_rows == (BY_LINEAR,) * CPU_FEW_ROWS
    assert calls["mm"] == timed, "a model of the same shapes was timed again"


def test_the_paths_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row count goes the way its entry says, more rows the way `many_rows` says."""
    _keep_paths(monkeypatch)
    calls: list[str] = []
    real_mm, real_linear = torch.mm, F.linear
    monkeypatch.setattr(layers.torch, "mm", lambda *a: calls.append("mm") or real_mm(*a))
    monkeypatch.setattr(layers.F, "linear", lambda *a: calls.append("linear") or real_linear(*a))
    weight = torch.randn(8, 4)
    paths = _every_row_count({1: AS_TWO_ROWS, 3: WEIGHT_FIRST, 4: BY_LINEAR})
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", paths)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "many_rows", BY_LINEAR)
    for rows in (1, 3, 4, CPU_FEW_ROWS + 1):
        linear(torch.randn(rows, 4), weight)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", _every_row_count({}))
    monkeypatch.setattr(CPU_LINEAR_PATHS, "many_rows", WEIGHT_FIRST)
    linear(torch.randn(1, 4), weight)
    linear(torch.randn(CPU_FEW_ROWS + 1, 4), weight)
    assert calls == ["mm", "mm", "linear", "linear", "linear", "mm"]


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_a_weight_without_its_copy_takes_the_fastest_unpacked_path(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a packed path is chosen: a weight without its copy (a slice, a module measured apart) and
    an input that wants gradients take the row count's unpacked choice, and gradients flow."""
    _keep_paths(monkeypatch)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", (path,) * CPU_FEW_ROWS)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "many_rows", path)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "unpacked_by_rows", (WEIGHT_FIRST,) * CPU_FEW_ROWS)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "unpacked_many_rows", WEIGHT_FIRST)
    weight = torch.randn(96, 64)
    assert pack_cpu_weights([weight], path)
    taken: list[str] = []
    real_product = layers._product
    monkeypatch.setattr(layers, "_product", lambda x, w, p: taken.append(p) or real_product(x, w, p))
    for rows in (3, CPU_FEW_ROWS + 2):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(linear(x, weight[:50]), F.linear(x, weight[:50]), rtol=1e-4, atol=1e-4)
        wanting = x.clone().requires_grad_()
        linear(wanting, weight).sum().backward()
        torch.testing.assert_close(wanting.grad, weight.sum(0).expand(rows, -1), rtol=1e-4, atol=1e-4)
    assert taken == [path, WEIGHT_FIRST, WEIGHT_FIRST] * 2


def _fake_pass_times(cost: dict[str, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each product by a path advances a fake clock by `cost[path]`; nothing measured before."""
    clock = [0.0]

    def product(flat: torch.Tensor, weight: torch.Tensor, path: str) -> None:
        clock[0] += cost[path]

    _keep_paths(monkeypatch)
    monkeypatch.setattr(layers, "_product", product)
    monkeypatch.setattr(layers.time, "perf_counter", lambda: clock[0])


@pytest.mark.parametrize(("weight_first_share", "chosen"), [(0.95, BY_LINEAR), (0.85, WEIGHT_FIRST)])
def test_another_path_is_taken_only_when_it_clearly_wins(
    weight_first_share: float, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pass times set by a fake clock: a path a little faster than F.linear (within CLEAR_WIN) is
    not taken, one clearly faster is."""
    _fake_pass_times(
        {BY_LINEAR: 1.0, WEIGHT_FIRST: weight_first_share, AS_TWO_ROWS: 2.0, PACKED: 2.0, ONEDNN: 2.0},
        monkeypatch,
    )
    paths = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert paths.by_rows == paths.unpacked_by_rows == (BY_LINEAR,) + (chosen,) * (CPU_FEW_ROWS - 1)
    assert paths.many_rows == paths.unpacked_many_rows == BY_LINEAR


@pytest.mark.parametrize("path", PACKED_PATHS)
@pytest.mark.parametrize(("packed_share", "chosen"), [(1.0, BY_LINEAR), (0.95, BY_LINEAR), (0.5, "packed")])
def test_a_packed_path_is_taken_where_it_clearly_wins(
    path: str, packed_share: float, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fake clock: a packed path is taken only where it clearly beats F.linear (CLEAR_WIN), as any
    other path, at few rows and many; a module whose packed path is taken nowhere keeps no copies of
    it; the unpacked choice stays F.linear."""
    other = ONEDNN if path == PACKED else PACKED
    _fake_pass_times(
        {BY_LINEAR: 1.0, WEIGHT_FIRST: 2.0, AS_TWO_ROWS: 2.0, path: packed_share, other: 3.0}, monkeypatch
    )
    module = torch.nn.Linear(8, 16)
    expected = path if chosen == "packed" else BY_LINEAR
    paths = measure_cpu_linear_paths(module)
    assert paths.by_rows == (expected,) * CPU_FEW_ROWS and paths.many_rows == expected
    assert paths.unpacked_by_rows == (BY_LINEAR,) * CPU_FEW_ROWS and paths.unpacked_many_rows == BY_LINEAR
    assert hasattr(module.weight, layers.COPY_ATTRIBUTE[path]) == (expected == path)
    assert not hasattr(module.weight, layers.COPY_ATTRIBUTE[other])


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_a_packed_row_is_that_row_computed_alone_to_rounding(path: str) -> None:
    """Each row of a packed product is that row computed alone, to fp32 rounding, at every few-row
    count and at many rows, and the product is F.linear's. (Bit for bit only on some CPUs and shapes:
    Intel's MKL on the Xeon gave every row exactly; oneDNN on an AMD EPYC at 2-64 rows, and a row alone
    too up to 1024-wide inputs; MKL's rows on the EPYC differ by up to ~15 units in the last place from
    4 rows on, as F.linear's do from 2 on every CPU seen: a verify window's rows round as decode rows
    only there.)"""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = torch.randn(384, 256, generator=gen)
    assert pack_cpu_weights([weight], path)
    for rows in (*range(1, CPU_FEW_ROWS + 1), MANY_ROWS):
        x = torch.randn(rows, 256, generator=gen)
        together = layers._product(x, weight, path)
        alone = torch.cat([layers._product(x[r : r + 1], weight, path) for r in range(rows)])
        torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4, msg=f"{rows} rows")
        torch.testing.assert_close(together, F.linear(x, weight), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_weights_are_packed_only_where_the_copies_fit(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No packed copies when they would take more than PACKED_MEMORY_SHARE of the available memory, for
    a dtype the path does not take (fp16; bf16 but for oneDNN; mixed dtypes), or without the library;
    the packed path of an unpacked weight is F.linear."""
    attribute = layers.COPY_ATTRIBUTE[path]
    weight = torch.randn(64, 32)
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 4 * weight.numel() * 4)
    assert not pack_cpu_weights([weight], path) and not hasattr(weight, attribute)
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 1 << 40)
    assert not pack_cpu_weights([weight.to(torch.float16)], path)
    assert pack_cpu_weights([weight.to(torch.bfloat16)], path) == (path == ONEDNN and _onednn_takes_bf16())
    assert not pack_cpu_weights([torch.randn(64, 32), torch.randn(64, 32).to(torch.bfloat16)], path)
    assert pack_cpu_weights([weight], path) and hasattr(weight, attribute)
    x, other = torch.randn(3, 32), torch.randn(64, 32)
    torch.testing.assert_close(layers._product(x, other, path), F.linear(x, other))
    monkeypatch.setattr(layers, "packs_on_this_cpu", lambda path=PACKED: False)
    assert not pack_cpu_weights([torch.randn(64, 32)], path)


@needs_onednn_bf16
def test_bf16_rows_over_onednn_are_the_fp32_product_rounded() -> None:
    """oneDNN's bf16 product over a packed copy, at every few-row count and at many rows: bf16 rows of the
    right shape, each within bf16 rounding of the fp32 product of the same bf16 values (it accumulates
    in fp32) and of that row computed alone. (Bit for bit alone or among others only up to 1024-wide
    inputs on the EPYC: wider ones are split differently by row count, as in fp32.)"""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = torch.randn(384, 1536, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        assert pack_cpu_weights([weight], ONEDNN)
        for rows in (*range(1, CPU_FEW_ROWS + 1), MANY_ROWS):
            x = torch.randn(rows, 1536, generator=gen).to(torch.bfloat16)
            together = layers._product(x, weight, ONEDNN)
            assert together.dtype == torch.bfloat16 and together.shape == (rows, 384)
            alone = torch.cat([layers._product(x[r : r + 1], weight, ONEDNN) for r in range(rows)])
            torch.testing.assert_close(together, alone, rtol=1e-2, atol=1e-2, msg=f"{rows} rows")
            exact = F.linear(x.float(), weight.float())
            torch.testing.assert_close(together.float(), exact, rtol=1e-2, atol=1e-2)


def test_each_dtype_has_its_own_measured_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model measured after an fp32 one keeps its choice apart: the fp32 weights still take the
    fp32 choice (one process may hold engines of both dtypes: benchmarks, tests), and `linear` takes
    each weight's dtype's choice."""
    _keep_paths(monkeypatch)
    _fake_pass_times({BY_LINEAR: 1.0, WEIGHT_FIRST: 0.5, AS_TWO_ROWS: 0.5, "other": 3.0}, monkeypatch)
    monkeypatch.setattr(layers, "COPY_ATTRIBUTE", {})
    fp32 = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert fp32 is CPU_LINEAR_PATHS and fp32.by_rows[1] == WEIGHT_FIRST
    _fake_pass_times({BY_LINEAR: 0.2, WEIGHT_FIRST: 0.5, AS_TWO_ROWS: 0.5, "other": 3.0}, monkeypatch)
    bf16 = measure_cpu_linear_paths(torch.nn.Linear(8, 16).to(torch.bfloat16))
    assert bf16 is layers.cpu_linear_paths(torch.bfloat16) and bf16 is not CPU_LINEAR_PATHS
    assert bf16.by_rows == (BY_LINEAR,) * CPU_FEW_ROWS
    assert CPU_LINEAR_PATHS.by_rows[1] == WEIGHT_FIRST  # the fp32 choice stands
    taken = []
    monkeypatch.setattr(
        layers, "_product", lambda flat, weight, path: taken.append(path) or F.linear(flat, weight)
    )
    linear(torch.randn(2, 8), torch.randn(16, 8))
    linear(torch.randn(2, 8).to(torch.bfloat16), torch.randn(16, 8).to(torch.bfloat16))
    assert taken == [WEIGHT_FIRST]  # the bf16 product went to F.linear, its choice


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_a_library_that_packs_but_cannot_multiply_leaves_no_copies(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing tries one product over a copy; where it fails (a build whose op exists but does not
    run on this CPU), no weight keeps a copy and the path is not offered."""

    def fails(flat: torch.Tensor, weight: torch.Tensor, path: str) -> torch.Tensor:
        raise RuntimeError("no kernel for this CPU")

    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 1 << 40)
    monkeypatch.setattr(layers, "_product", fails)
    weights = [torch.randn(64, 32), torch.randn(16, 64)]
    assert not pack_cpu_weights(weights, path)
    assert not any(hasattr(w, layers.COPY_ATTRIBUTE[path]) for w in weights)


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_a_model_measured_again_without_room_for_its_copies_takes_the_unpacked_choice(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second model of the same shapes takes the first one's choice, its copies made again; where they
    no longer fit, the rows that took the packed path take the unpacked choice instead."""
    _fake_pass_times(
        {BY_LINEAR: 1.0, WEIGHT_FIRST: 0.5, AS_TWO_ROWS: 0.5, path: 0.2, "other": 3.0}, monkeypatch
    )
    monkeypatch.setattr(layers, "COPY_ATTRIBUTE", {path: layers.COPY_ATTRIBUTE[path]})
    assert measure_cpu_linear_paths(torch.nn.Linear(8, 16)).by_rows == (path,) * CPU_FEW_ROWS
    again = torch.nn.Linear(8, 16)
    assert measure_cpu_linear_paths(again).by_rows == (path,) * CPU_FEW_ROWS
    assert hasattr(again.weight, layers.COPY_ATTRIBUTE[path])
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 0)
    paths = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert paths.by_rows == (AS_TWO_ROWS,) + (WEIGHT_FIRST,) * (CPU_FEW_ROWS - 1)
    assert paths.many_rows == BY_LINEAR


@needs_onednn
def test_a_drafters_weights_get_the_copies_the_measured_paths_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_like_measured gives weights measured apart (a drafter's, its draft head) copies of the
    packed paths `CPU_LINEAR_PATHS` takes, and none of the others; a copy already there is kept."""
    _keep_paths(monkeypatch)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", (AS_TWO_ROWS,) + (ONEDNN,) * (CPU_FEW_ROWS - 1))
    monkeypatch.setattr(CPU_LINEAR_PATHS, "many_rows", BY_LINEAR)
    drafter = torch.nn.Linear(32, 48, bias=False)
    head, shared = torch.randn(100, 32), torch.randn(64, 32)
    assert pack_cpu_weights([shared], ONEDNN)
    kept = shared.onednn_packed
    pack_like_measured([drafter.weight, head, shared, torch.randn(7)])
    assert hasattr(drafter.weight, "onednn_packed") and hasattr(head, "onednn_packed")
    assert shared.onednn_packed is kept
    assert not any(hasattr(w, "mkl_packed") for w in (drafter.weight, head, shared))
    x = torch.randn(3, 32)
    torch.testing.assert_close(linear(x, head), F.linear(x, head), rtol=1e-4, atol=1e-4)


def _measured_in_file(file, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store over `file` with nothing in memory: what a new process on the machine starts with."""
    monkeypatch.setattr(layers, "MEASURED", MeasuredPaths(file))


def test_a_choice_measured_once_is_taken_from_the_machines_file_without_timing(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load measures and writes the choice to the file; a later process (a store with nothing
    in memory over the same file) takes it without timing a pass, and its copies are made for it."""
    _fake_pass_times({BY_LINEAR: 1.0, WEIGHT_FIRST: 0.5, AS_TWO_ROWS: 0.5, "other": 3.0}, monkeypatch)
    monkeypatch.setattr(layers, "COPY_ATTRIBUTE", {})
    file = tmp_path / "paths.json"
    _measured_in_file(file, monkeypatch)
    first = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert first.by_rows == (AS_TWO_ROWS,) + (WEIGHT_FIRST,) * (CPU_FEW_ROWS - 1)
    assert file.is_file()

    def never(*args, **kwargs):
        raise AssertionError("a choice in the machine's file was timed again")

    monkeypatch.setattr(layers, "_measure", never)
    for name in FIELDS:  # the new process's unmeasured default
        monkeypatch.setattr(CPU_LINEAR_PATHS, name, getattr(layers.CpuLinearPaths(), name))
    _measured_in_file(file, monkeypatch)
    again = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert again is CPU_LINEAR_PATHS and again.by_rows == first.by_rows and again.many_rows == first.many_rows


def test_another_machine_s_choice_or_an_unreadable_file_is_measured_again(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file's choice holds for its key only: other weight shapes, another kernel build or thread
    count are measured; a corrupt file, or an entry naming a path this version does not know, is
    measured again and the file rewritten with the new choice."""
    store = MeasuredPaths(tmp_path / "paths.json")
    shapes = (((16, 8), torch.float32),)
    base = store.key(shapes, "avx2-0123")
    assert store.key(shapes, "avx2-0123") == base
    assert store.key((((16, 9), torch.float32),), "avx2-0123") != base
    assert store.key(shapes, "avx2-4567") != base and store.key(shapes, None) != base
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert store.key(shapes, "avx2-0123") != base
    finally:
        torch.set_num_threads(threads)

    _fake_pass_times({BY_LINEAR: 1.0, WEIGHT_FIRST: 0.5, AS_TWO_ROWS: 0.5, "other": 3.0}, monkeypatch)
    monkeypatch.setattr(layers, "COPY_ATTRIBUTE", {})
    timed = []
    real_measure = layers._measure
    monkeypatch.setattr(layers, "_measure", lambda *a, **k: timed.append(1) or real_measure(*a, **k))
    file = tmp_path / "corrupt.json"
    file.write_text("{not json")
    _measured_in_file(file, monkeypatch)
    measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert timed == [1]
    entries = json.loads(file.read_text())
    (key,) = entries
    entries[key]["by_rows"][0] = "a path of a later version"
    file.write_text(json.dumps(entries))
    _measured_in_file(file, monkeypatch)
    measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert timed == [1, 1]
    assert json.loads(file.read_text())[key]["by_rows"][0] == AS_TWO_ROWS


def test_a_new_process_loads_the_choice_an_earlier_one_measured(tmp_path) -> None:
    """Two real processes on one extension root (`TORCH_EXTENSIONS_DIR`): the first measures a model's
    paths and keeps them in the root's file, the second takes them from it without measuring."""
    script = (
        "import sys, torch\n"
        "from dspark.runner.models import layers\n"
        "# torch's extension builder imports setuptools (a bare venv, a GPU machine's, may lack it):\n"
        "# importing the layers must not import it\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
        "layers.kernel_here = lambda: False  # a fresh root would build the kernel (~30 s)\n"
        "timed = []\n"
        "real = layers._measure\n"
        "layers._measure = lambda *a, **k: timed.append(1) or real(*a, **k)\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))\n"
        "paths = layers.measure_cpu_linear_paths(model)\n"
        "print(len(timed), paths.describe())\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first, second = (
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    )
    assert (tmp_path / "dspark_cpu_linear_paths.json").is_file()
    assert first.split(" ", 1)[0] == "1" and second.split(" ", 1)[0] == "0"
    assert first.split(" ", 1)[1] == second.split(" ", 1)[1]


def test_without_torch_s_extension_builder_the_choice_stays_in_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch's extension builder cannot be imported (no setuptools) and no TORCH_EXTENSIONS_DIR is
    set, there is no machine file: the store keeps choices in memory and raises nothing."""
    from dspark.runner.models import measured_paths

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # its import raises ImportError
    assert measured_paths.default_file() is None
    store = MeasuredPaths(measured_paths.default_file)
    store.put("key", {"by_rows": []})
    assert store.file is None and store.get("key") == {"by_rows": []}
