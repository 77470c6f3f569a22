"""benchmarks/step_profile.py (gpu_e2e.py --parts profile): kernel names to categories, GEMMs to their
projections, and the whole part on the CPU with a tiny random model (no graphs, CPU ops for kernels)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_e2e  # noqa: E402
import step_profile as sp  # noqa: E402

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

# Names as the CUDA profiler reports them: cuBLAS / cuBLASLt, this repo's Triton kernels
# (backend/dspark/kernels/*.py) and PyTorch's own.
KERNEL_NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_"
    "kernel__5x_cublas": "gemm",
    "nvjet_tst_64x8_64x16_2x1_v_bz_coopA_TNN": "gemm",
    "nvjet_hsh_128x64_64x4_1x2_h_bz_coopB_NNT": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, "
    "false, true, false, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 "
    "const>, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<"
    "__nv_bfloat16>, float> >(float, float)": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>("
    "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, "
    "false, false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, "
    "float const*, float const*, __nv_bfloat16 const*, void*, long, float*, int*)": "gemm",
    "_paged_attention_kernel": "attention",
    "_combine_splits_kernel": "attention_combine",
    "flash_fwd_splitkv_kernel": "attention",
    "flash_fwd_splitkv_combine_kernel": "attention_combine",
    "_rms_norm_kernel": "rmsnorm",
    "_rotary_store_kernel": "rotary_store_kv",
    "_silu_mul_kernel": "silu_mul",
    "_window_bounds_kernel": "layout",
    "_positions_slots_kernel": "layout",
    "_verify_tokens_kernel": "layout",
    "_greedy_accept_kernel": "sampling",
    "_race_partial_kernel": "sampling",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
    "unsigned int, long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, "
    "4>)": "sampling",
    "void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, "
    "2, -2>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<"
    "c10::BFloat16 const, unsigned int>, at::cuda::detail::TensorInfo<long const, unsigned int>, int, int, "
    "unsigned int, unsigned int, long)": "embedding",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::"
    "{lambda(c10::BFloat16)#1}, "
    "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>>(int)": "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, std::array<char*, "
    "1ul> >(int, at::native::FillFunctor<long>, std::array<char*, 1ul>)": "copies",
    "Memcpy HtoD (Pinned -> Device)": "copies",
    "Memset (Device)": "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<long>, std::array<char*, "
    "3ul> >(int, at::native::CUDAFunctor_add<long>, std::array<char*, 3ul>)": "other",
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "mkl::_mkl_linear": "gemm",
    "aten::argmax": "sampling",
    "aten::copy_": "copies",
    "aten::mul": "other",
}


@pytest.mark.parametrize(("name", "category"), list(KERNEL_NAMES.items()))
def test_kernel_category_by_name(name: str, category: str) -> None:
    assert sp.kernel_category(name) == category


def test_split_k_reduce_goes_with_its_gemm() -> None:
    reduce, main = [n for n in KERNEL_NAMES if "splitK" in n], "nvjet_tst_64x8_64x16_2x1_v_bz_coopA_TNN"
    assert sp.is_split_k_reduce(reduce[0]) and not sp.is_split_k_reduce(main)


def _event(name: str, start: float, end: float, device=CPU, id: int = 0, kernels=()) -> SimpleNamespace:
    """A stand-in for torch.autograd.profiler_util.FunctionEvent with the fields step_profile reads."""
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        device_type=device,
        id=id,
        kernels=list(kernels),
        cpu_children=[],
    )


def _cuda_profile(kinds_match: bool) -> list[SimpleNamespace]:
    """Two scopes (qkv, then attention) each launching one kernel. Runtime calls pair with kernels by
    correlation id; kinds_match False: the ids pair each kernel with a memcpy call in the other scope,
    which must not be trusted, and the CPU op listing the kernel (its `kernels`) gives the launch."""
    gemm, attn = "nvjet_tst_64x8_64x16_2x1_v_bz_coopA_TNN", "_paged_attention_kernel"
    call = "cudaLaunchKernel" if kinds_match else "cudaMemcpyAsync"
    gemm_id, attn_id = (7, 8) if kinds_match else (8, 7)
    return [
        _event("dspark::step", 0, 100),
        _event("dspark::qkv", 10, 20),
        _event("aten::mm", 11, 19, kernels=[SimpleNamespace(name=gemm, device=0, duration=5.0)]),
        _event(call, 12, 13, id=gemm_id),
        _event("dspark::attention", 30, 40),
        _event(call, 31, 32, id=attn_id),
        _event("dspark::attention", 30.5, 39, kernels=[SimpleNamespace(name=attn, device=0, duration=4.0)]),
        # Device events run after their launches, outside every scope's host time.
        _event(gemm, 50, 55, CUDA, id=7),
        _event(attn, 60, 64, CUDA, id=8),
        _event("Memcpy HtoD (Pinned -> Device)", 70, 71, CUDA, id=9),  # no call, no owner: no scope
        # The scopes as the profiler projects them onto the device timeline (gpu_user_annotation): the
        # spans of the kernels above, no kernels themselves.
        _event("dspark::step", 50, 71, CUDA),
        _event("dspark::qkv", 50, 55, CUDA),
    ]


@pytest.mark.parametrize("kinds_match", [True, False])
@pytest.mark.parametrize("launched_late", [False, True])
def test_cuda_kernels_get_their_launching_scope(kinds_match: bool, launched_late: bool) -> None:
    events = _cuda_profile(kinds_match)
    if launched_late:  # ids that pair a kernel with a call made after it started: not trusted either
        events[3].time_range = SimpleNamespace(start=51, end=52)
    kernels = sp.collect_kernels(events, "cuda")
    assert [(k.name[:6], k.scope, k.dur_us) for k in kernels] == [
        ("nvjet_", "qkv", 5.0),
        ("_paged", "attention", 4.0),
        ("Memcpy", None, 1.0),
    ]
    assert sp.label_gemms(kernels, num_layers=1) == "scope"
    assert [k.category for k in kernels] == ["gemm:qkv", "attention", "copies"]
    assert sp.summarize(kernels, steps=2)["attention"] == {
        "count": 0.5,
        "ms": 0.002,
        "names": {"_paged_attention_kernel": 0.002},
    }


def _unscoped_gemms(names: list[str]) -> list[sp.Kernel]:
    return [sp.Kernel(name, float(i), 1.0) for i, name in enumerate(names)]


def test_gemms_without_scopes_are_labelled_by_launch_order() -> None:
    gemv, reduce = "gemv2T_kernel_val<...>", "void cublasLt::splitKreduce_kernel<...>"
    # Two layers of qkv, o (split-K: a main kernel and its reduction), gate_up, down, then the LM head.
    names = [gemv, gemv, reduce, gemv, gemv] * 2 + [gemv]
    kernels = _unscoped_gemms(names) + [sp.Kernel("_rms_norm_kernel", 99.0, 1.0)]
    assert sp.label_gemms(kernels, num_layers=2) == "launch order"
    assert [k.projection for k in kernels[:5]] == ["qkv", "o", "o", "gate_up", "down"]
    assert kernels[10].category == "gemm:lm_head" and kernels[11].category == "rmsnorm"
    # A count that does not fit whole steps labels nothing (rather than shifting every label).
    uneven = _unscoped_gemms([gemv] * 10)
    assert sp.label_gemms(uneven, num_layers=2) == "none"
    assert {k.category for k in uneven} == {"gemm:?"}


def test_scopes_and_order_are_compared_when_both_work() -> None:
    kernels = _unscoped_gemms(["gemv"] * 5)
    for k, scope in zip(kernels, ["qkv", "o", "gate_up", "down", "o"], strict=True):
        k.scope = scope
    assert sp.label_gemms(kernels, num_layers=1) == "scope (launch order agrees on 80%)"


def test_parse_configs() -> None:
    assert sp.parse_configs("1x1, 8x1,1x8,4") == [(1, 1), (8, 1), (1, 8), (4, 1)]


@pytest.fixture
def one_thread():
    """One intra-op thread: on a loaded two-core machine two threads' tiny matmuls wait on each other
    for milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


EXPECTED = {
    "gemm:qkv",
    "gemm:o",
    "gemm:gate_up",
    "gemm:down",
    "gemm:lm_head",
    "attention",
    "rmsnorm",
    "rotary_store_kv",
    "silu_mul",
    "embedding",
    "sampling",
}


@pytest.fixture
def unfused_cpu_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's CPU products off the CPU kernel, whose fused SwiGLU (`silu_mul_rows`, counted
    under `gemm:gate_up`) leaves no `silu_mul` op to profile. Whether a model load takes the kernel is
    timed when it loads (a near tie at the tiny shapes on a 2-core host) and remembered per weight
    shapes for the process: in one clean-clone run of the suite it was taken, in others not."""
    from dspark.runner.models import layers
    from dspark.runner.models.measured_paths import MeasuredPaths

    monkeypatch.setattr(layers, "kernel_here", lambda: False)
    monkeypatch.setattr(layers, "MEASURED", MeasuredPaths())


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_profile_part_on_the_cpu(
    graphs: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
    unfused_cpu_products: None,
) -> None:
    """The whole part on the CPU: plain (no graphs there), and with emulated graphs, which run the
    graph-replay path (its timing, its profile beside the eager one) eagerly."""
    real = sp.profile_config

    def failing_for_batch_2(row: dict, *args, **kwargs) -> None:
        if row["batch"] == 2:
            raise RuntimeError("planted failure")
        real(row, *args, **kwargs)

    monkeypatch.setattr(sp, "profile_config", failing_for_batch_2)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--parts", "profile", "--device", "cpu"]
    argv += ["--shape", "tiny", "--context", "40", "--profile-configs", "1x1,2x1,3x4", "--repeats", "3"]
    argv += ["--profile-steps", "2", "--trace"] + (["--emulate-graphs"] if graphs else [])
    assert gpu_e2e.main(argv) == 0
    report = json.loads((out / "results.json").read_text())
    errors = report["errors"]
    assert set(errors) == {"profile b2w1 profile"} and "planted failure" in errors["profile b2w1 profile"]
    section = report["profile"]
    rows = section["configs"]
    assert [(r["batch"], r["window"], r["tokens"]) for r in rows] == [(1, 1, 1), (2, 1, 2), (3, 4, 12)]
    # The failed profile leaves that config's timings and floor, and the others' profiles.
    unprofiled = rows.pop(1)
    assert unprofiled["step_ms"] > 0 and unprofiled["floor_ms"] > 0 and "eager_profile" not in unprofiled
    arch = gpu_e2e.SHAPES["tiny"][0]
    layers, hidden, inter = arch["num_hidden_layers"], arch["hidden_size"], arch["intermediate_size"]
    for row in rows:
        if graphs:
            assert row["step_timing"] == "graph replay, emulated, wall clock"
            assert row["step_ms"] == row["graph_ms"] > 0 and row["graph_kernels_visible"] > 0
            # The replay's CPU ops run outside every scope: named by themselves (GEMMs unlabelled).
            assert {"attention", "embedding", "sampling", "gemm:?"} <= set(row["graph_profile"])
            graph_sum = sum(entry["ms"] for entry in row["graph_profile"].values())
            assert graph_sum == pytest.approx(row["graph_kernel_sum_ms"]) and graph_sum > 0
            assert row["graph_gap_ms"] == pytest.approx(row["graph_ms"] - graph_sum)
        else:
            assert "graph_ms" not in row and row["step_timing"] == "eager, wall clock"
        profile = row["eager_profile"]
        assert EXPECTED <= set(profile), set(profile)
        assert all(profile[key]["ms"] > 0 and profile[key]["count"] > 0 for key in EXPECTED)
        assert row["gemm_labels"] == "scope"
        # Each op's own time: together they fit in the profiled steps' host time.
        kernel_sum = sum(entry["ms"] for entry in profile.values())
        assert kernel_sum == pytest.approx(row["kernel_sum_ms"])
        assert 0 < row["kernel_sum_ms"] <= row["profiled_step_ms"] * 1.001
        # The floor's split adds up to part_step's floor, and the excesses (with the gaps) to the rest.
        kv = row["batch"] * (40 + row["window"]) * 2 * layers * arch["num_key_value_heads"] * arch["head_dim"]
        weights = layers * (
            hidden * (arch["num_attention_heads"] + 2 * arch["num_key_value_heads"]) * arch["head_dim"]
            + arch["num_attention_heads"] * arch["head_dim"] * hidden
            + 3 * hidden * inter
            + 2 * hidden
            + 2 * arch["head_dim"]
        )
        weights += arch["vocab_size"] * hidden + hidden
        floor_ms = (weights + kv) * 4 / (section["copy_bandwidth_GBs"] * 1e9) * 1e3  # float32 on the CPU
        assert row["floor_ms"] == pytest.approx(floor_ms)
        assert sum(row["excess_ms"].values()) == pytest.approx(row["step_ms"] - row["floor_ms"])
        assert list(row["excess_ms"].values()) == sorted(row["excess_ms"].values(), reverse=True)
        gemms = {g["projection"]: g for g in row["gemms"]}
        assert set(gemms) == set(sp.PROJECTIONS)
        assert gemms["down"]["n"] == hidden and gemms["down"]["k"] == inter
        assert gemms["gate_up"]["n"] == 2 * inter and gemms["lm_head"]["calls"] == 1
        assert all(g["us_per_call"] > 0 and g["GBs"] > 0 and g["m"] == row["tokens"] for g in gemms.values())
    alone = {(a["projection"], a["m"]) for a in section["linear_alone"]}
    assert alone == {(p, m) for p in sp.PROJECTIONS for m in (1, 2, 12)}
    assert all(a["us_per_call"] > 0 and a["of_copy_bandwidth"] > 0 for a in section["linear_alone"])
    md = (out / "results.md").read_text()
    step = "graph" if graphs else "eager step"
    assert f"### batch 1 window 1: {step}" in md and "largest excess" in md
    assert f"### batch 2 window 1: {step}" in md and "not profiled" in md
    assert ("| graph ms |" in md) == graphs and ("Graph replay profiled" in md) == graphs
    assert "| gemm down (M=12, N=64, K=128) |" in md and "### F.linear alone" in md
    trace = out / "trace-b1-w1-eager.json.gz"
    assert 0 < trace.stat().st_size < sp.TRACE_LIMIT_BYTES
    names = {e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert {"dspark::qkv", "dspark::attention", "dspark::step"} <= names
    # The raw traces are gone.
    traces = [trace.name] + (["trace-b1-w1-graph.json.gz"] if graphs else [])
    assert sorted(p.name for p in out.iterdir()) == sorted(["results.json", "results.md", *traces])

    # The tables have as many cells in every row as in their header.
    lines = md.splitlines()
    for header in [line for line in lines if line.startswith(("| category", "| projection | M"))]:
        start = lines.index(header)
        end = lines.index("", start)
        assert {line.count("|") for line in lines[start:end]} == {header.count("|")}, lines[start:end]


def test_budget_spent_skips_the_part_and_still_writes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path), "--parts", "profile", "--device", "cpu"]
    assert gpu_e2e.main([*argv, "--shape", "tiny", "--budget-s", "1e-9"]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["errors"] == {"profile": "skipped: --budget-s ran out"}
    assert "profile" not in report and (out / "results.md").is_file()
