"""Dependent launches (kernels/common.py, `dependent_launch`): never off CUDA or in the interpreter; on a
Hopper GPU the per-layer kernels of a decode step, chained and replayed from one CUDA graph, give the
same bits launched dependent on each other (each letting the next launch early or not) as launched one
after the other ended. Each such kernel waits for the one before it before it loads or stores; a kernel
that did not would read its input half written, which this chain (every kernel reads what the one
before it just wrote) would show.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import kernel_parity as parity
import torch
from kernel_setup import DEVICE, KERNELS, gpu_only


def test_no_dependent_launch_off_cuda_or_in_the_interpreter():
    assert KERNELS.common.dependent_launch(torch.device("cpu")) == 0
    if DEVICE.type == "cpu":
        assert KERNELS.common.INTERPRET


@gpu_only
def test_a_hopper_gpu_launches_the_layer_kernels_dependent():
    hopper = torch.cuda.get_device_capability(DEVICE)[0] >= 9
    assert KERNELS.common.dependent_launch(DEVICE) == (2 if hopper else 0)


def _layers(x, residual, weights, case, kernels):
    """A decode step's kernel chain, a few layers deep: norm, qkv product, attention (split over the
    cache), o product, norm, gate/up product with the activation, down product."""
    hidden = x.shape[-1]
    heads, head_dim = case.q.shape[1], case.q.shape[2]
    for norm_w, qkv_w, o_w, norm2_w, gate_up_w, down_w in weights:
        h, residual = kernels.norm.rms_norm(x, norm_w, 1e-6, residual)
        q = kernels.gemv.gemv(h, qkv_w).view(-1, heads, head_dim)
        attended = kernels.attention.paged_attention(
            q, case.k_cache, case.v_cache, case.page_table, case.cu_seqlens, case.kv_lens, case.scale, False
        )
        x = kernels.gemv.gemv(attended.reshape(-1, heads * head_dim), o_w)
        h, residual = kernels.norm.rms_norm(x, norm2_w, 1e-6, residual)
        x = kernels.gemv.gemv(kernels.gemv.silu_mul_gemv(h, gate_up_w), down_w)
        assert x.shape[-1] == hidden
    return x + residual


def _replayed(fn, device: torch.device) -> torch.Tensor:
    """fn() captured in a CUDA graph (after a warm-up that compiles), replayed twice; its output."""
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize(device)
    return out.clone()


@gpu_only
def test_a_layer_chain_replayed_from_a_graph_gives_the_same_bits_with_dependent_launches(gen):
    rows, hidden, inter, heads, head_dim, layers = 4, 1024, 2816, 8, 128, 6
    dtype = torch.bfloat16
    case = parity.make_attention_case(
        [1] * rows, [700, 33, 1500, 260], heads, heads, head_dim, 16, False, dtype, DEVICE, gen
    )

    def w(n, k):
        return parity.randn((n, k), dtype, DEVICE, gen) / math.sqrt(k)

    def norm():
        return (1 + 0.1 * parity.randn((hidden,), torch.float32, DEVICE, gen)).to(dtype)

    weights = [
        (
            norm(),
            w(heads * head_dim, hidden),
            w(hidden, heads * head_dim),
            norm(),
            w(2 * inter, hidden),
            w(hidden, inter),
        )
        for _ in range(layers)
    ]
    x = parity.randn((rows, hidden), dtype, DEVICE, gen)
    residual = parity.randn((rows, hidden), dtype, DEVICE, gen)
    common = KERNELS.common
    outputs = {}
    saved = common.DEPENDENT_LAUNCH, common.LAUNCH_NEXT_EARLY
    # (dependent, the next kernel launched early): each way the same bits, replayed and eager.
    modes = ((True, True), (True, False), (False, False))
    try:
        for mode in modes:
            common.DEPENDENT_LAUNCH, common.LAUNCH_NEXT_EARLY = mode
            outputs[mode] = _replayed(lambda: _layers(x, residual, weights, case, KERNELS), DEVICE)
            outputs[mode, "eager"] = _layers(x, residual, weights, case, KERNELS)
    finally:
        common.DEPENDENT_LAUNCH, common.LAUNCH_NEXT_EARLY = saved
    plain = outputs[False, False]
    assert not torch.isnan(plain).any()
    for mode in modes:
        assert torch.equal(outputs[mode], plain), mode
        assert torch.equal(outputs[mode, "eager"], plain), mode


def _kernel_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """The module's @triton.jit functions (autotuned or not) by name."""

    def jitted(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return isinstance(target, ast.Attribute) and target.attr == "jit"

    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any(jitted(d) for d in node.decorator_list)
    }


_WRITES = ("store", "dot", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min")
# Inputs a kernel reads before its wait, each reviewed: never written by the kernel launched before it
# (the docstrings of paged_attention and rotary_store_kv: the step's layout is written before the layer's
# qkv projection and rotary + store, the kernels those two follow; cos_sin is a constant table).
_READ_BEFORE_WAIT = {
    ("attention.py", "_paged_attention_kernel"): {"cu_seqlens_ptr", "kv_lens_ptr"},
    ("rotary_store.py", "_rotary_store_kernel"): {"positions_ptr", "cos_sin_ptr", "slots_ptr"},
}


def test_every_kernel_launched_dependent_waits_before_anything_else():
    """Static check of the kernel modules: a launch that passes `launch_pdl` launches a kernel with a
    PDL parameter, passes it `pdl` and `launch_pdl=pdl > 0`, and that kernel's body runs
    `wait_for_previous(PDL)` at its top level before any store, dot or atomic, and before any read but
    those of _READ_BEFORE_WAIT; so no kernel added later can read or write before the kernel it follows
    ends."""
    kernels_dir = Path(KERNELS.common.__file__).parent
    launched = 0
    for path in sorted(kernels_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        functions = _kernel_functions(tree)
        for name, function in functions.items():
            if "PDL" not in [a.arg for a in function.args.args] or name == "wait_for_previous":
                continue
            waits = [
                i for i, s in enumerate(function.body) if ast.unparse(s).strip() == "wait_for_previous(PDL)"
            ]
            assert waits, f"{path.name}:{name} never waits at its top level"
            allowed = _READ_BEFORE_WAIT.get((path.name, name), set())
            before = ast.Module(body=function.body[: waits[0]], type_ignores=[])
            for call in (n for n in ast.walk(before) if isinstance(n, ast.Call)):
                called = (
                    call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                )
                assert called not in _WRITES, f"{path.name}:{name}: {ast.unparse(call)} before the wait"
                in_tl = isinstance(call.func, ast.Attribute) and ast.unparse(call.func.value) == "tl"
                if in_tl and called != "load":
                    continue  # tl arithmetic (where, arange, program_id): no read
                read = {n.id for n in ast.walk(call) if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
                assert read <= allowed, f"{path.name}:{name}: {ast.unparse(call)} reads before the wait"
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
            if "launch_pdl" not in keywords:
                continue
            launched += 1
            kernel = call.func.value.id if isinstance(call.func, ast.Subscript) else None
            assert kernel in functions, f"{path.name}: launch_pdl on {ast.unparse(call.func)}"
            pdl = keywords.get("PDL")
            assert pdl is not None and keywords["launch_pdl"] == f"{pdl} > 0", f"{path.name}:{kernel}"
    assert launched >= 6  # norm, gemv, rotary + store, attention and its combine, activation
