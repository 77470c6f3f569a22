"""x times W^T in fp32 on an x86-64 CPU with AVX2 and FMA (AVX-512 where the CPU has it), for any
number of rows (`linear.cpp`).

Why: a CPU decode step streams every weight once, and with one to a few rows (one request, or its
verify window) the library products fall short of the memory's bandwidth: on a 2-core AMD EPYC without
AVX-512, oneDNN's fp32 product took 20.4 ms a pass over SmolLM2's weights at one row and 26.6 ms at
four, this kernel 16.9 and 19.0 (session 56); on a 2-core Xeon with AVX-512, MKL's 23 and 38 ms, this
kernel 21 and 21 (session 58). Past 32 rows it runs cache-blocked tiles (64 rows: 120.9 ms against
oneDNN's 131.3 on the EPYC, 97 against MKL's 97 on the Xeon). Each output is summed in one fixed
order whatever rows are beside it, so a row gives the same bits alone, in a verify window or beside a
prefill chunk, and `layers.linear` takes it for every row count or none.

Built the first time a process asks for it, by torch's extension builder with the machine's C++
compiler, for the CPU's widest vectors (`isa`: AVX-512 or AVX2; each output's sum order follows the
lane count, so one machine has one order), and kept under torch's extension root
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) for the next processes (`make setup` builds
it once). Where there is no compiler, no AVX2 or the build fails, `available()` says False (once, with
the reason, in the log) and `layers.linear` keeps the library products.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
# The norm that feeds the products and the attention prologue's rotary + KV store, built into the same
# extension (one build, one load); the products and the norm include lanes.h, whose changes ninja's header
# tracking rebuilds.
SOURCES = (SOURCE, SOURCE.with_name("norm.cpp"), SOURCE.with_name("rotary.cpp"))
# The build's folder name (`build_directory` adds the torch, the Python, which the extension links
# against, and the vector width it is built for).
NAME = "dspark_cpu_linear"
# A build lock older than this was left by a process killed mid-build: removed, or every later process
# would wait on it for ever (torch's lock has no timeout). A build takes ~30 s on two cores.
STALE_LOCK_S = 600.0
# No multiply-add fused by the compiler: the products fuse theirs by hand, in their one order, and the
# rotary rounds x * cos and x' * sin apart as the reference does.
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"]
# Added where torch finds AVX-512 (its test: these four subsets), for 16-lane sums and 32 registers.
AVX512_FLAGS = ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw"]

_module: ModuleType | None = None
_tried = False


def extension_root() -> Path:
    """torch's own rule for its extensions' root: TORCH_EXTENSIONS_DIR, else its cache folder. ImportError
    where torch's extension builder cannot be imported (it imports setuptools, which a bare venv lacks)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_directory() -> Path:
    """Where the extension is built and kept."""
    # The vector width too: a build for AVX-512 must never load on a CPU without it (a shared root).
    version = torch.__version__.replace("+", "_")
    return extension_root() / f"{NAME}_torch{version}_py{sys.version_info[0]}{sys.version_info[1]}_{isa()}"


def isa() -> str:
    """The vectors the kernel is built for here: "avx512" where torch finds AVX-512, else "avx2"."""
    return "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2"


def build_id() -> str:
    """What the build computes with: its vector width and a digest of its sources (a choice measured
    with one build holds for that build only: `measured_paths`)."""
    digest = hashlib.sha256(
        b"".join(source.read_bytes() for source in (*SOURCES, SOURCE.with_name("lanes.h")))
    )
    return f"{isa()}-{digest.hexdigest()[:16]}"


def why_not() -> str | None:
    """Why this machine cannot build the kernel (None: it can try)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"torch reports {capability}, not AVX2"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler})"
    return None


def load() -> ModuleType | None:
    """The built extension, building it on the first call of the process (None where it cannot be)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    reason = why_not()
    if reason is not None:
        logger.info("CPU linear_rows kernel not used: %s", reason)
        return None
    start = time.monotonic()
    try:
        # torch's builder imports setuptools, which a bare Python 3.12 venv lacks: a failure like any other.
        from torch.utils.cpp_extension import load as build

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        _module = build(
            NAME,
            [str(source) for source in SOURCES],
            extra_cflags=FLAGS + (AVX512_FLAGS if isa() == "avx512" else []),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the library products in place
        logger.warning("CPU linear_rows kernel not built (%s): the library products stay", exc)
        _module = None
        return None
    if time.monotonic() - start > 2.0:
        logger.info("CPU linear_rows kernel built in %.0f s", time.monotonic() - start)
    return _module


def available() -> bool:
    """Whether the kernel runs here (builds it on the first call)."""
    return load() is not None


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, k] @ weight [n, k]^T -> [rows, n], fp32, contiguous operands (`available()` first)."""
    module = load()
    assert module is not None, "linear_rows: the kernel is not available on this machine"
    return module.linear_rows(x, weight)


def silu_mul_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) for weight [2n, k] = [Wg; Wu] -> [rows, n], fp32, contiguous operands, the
    products summed as `linear_rows` sums them (`available()` first)."""
    module = load()
    assert module is not None, "silu_mul_rows: the kernel is not available on this machine"
    return module.silu_mul_rows(x, weight)


def rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """reference.rms_norm for fp32 contiguous x [rows, h] (and residual): (normed, x + residual or None),
    each row normed alone (`available()` first)."""
    module = load()
    assert module is not None, "rms_norm_rows: the kernel is not available on this machine"
    got = module.rms_norm_rows(x, residual, weight, eps)
    return got[0], (got[1] if residual is not None else None)


def rotary_store_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """reference.rotary_store_kv without q/k norms, fp32, from the step's multipliers (`cos`, `sin` of a
    `reference.HostRotation`): k rotated and v stored at `slots` (negative: skipped), rotated q returned,
    the reference's bits (`available()` first)."""
    module = load()
    assert module is not None, "rotary_store_rows: the kernel is not available on this machine"
    return module.rotary_store_rows(q, k, v, cos, sin, k_cache, v_cache, slots)
