"""Fixtures shared by the whole test suite."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_SHIPPED_DEVICE_RUNS_AHEAD = []  # the engine's own device_runs_ahead, while the session's patch holds


@pytest.fixture(scope="session", autouse=True)
def _overlap_as_on_a_gpu():
    """The engine overlaps its steps only where the device runs them while the host goes on (a GPU;
    `llm_engine.device_runs_ahead`). Here every engine built on the CPU, module fixtures' too, takes
    the overlap path as a GPU would (the engine tests all ran it on the CPU before the engine turned it
    off there, and only the CPU runs in CI), and the tests that set `overlap_scheduling=False` keep the
    other path; a test marked `shipped_overlap` sees the engine's own choice."""
    from dspark.engine import llm_engine

    _SHIPPED_DEVICE_RUNS_AHEAD.append(llm_engine.device_runs_ahead)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "device_runs_ahead", lambda device: True)
        yield


@pytest.fixture(autouse=True)
def _shipped_overlap(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's own overlap choice for a test marked `shipped_overlap`."""
    if request.node.get_closest_marker("shipped_overlap") is not None:
        from dspark.engine import llm_engine

        monkeypatch.setattr(llm_engine, "device_runs_ahead", _SHIPPED_DEVICE_RUNS_AHEAD[0])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in Hugging Face layout, converted once from its packaged GGUF."""
    from dspark.config import DEFAULT_TARGET_DIR
    from dspark.tools.convert_gguf import default_gguf_path, import_gguf

    try:
        gguf_path = default_gguf_path()
    except FileNotFoundError as exc:  # set-up installs it: a missing model is a broken set-up, not a skip
        if (DEFAULT_TARGET_DIR / "config.json").is_file():
            return DEFAULT_TARGET_DIR  # converted from a GGUF given by path (a bare GPU machine)
        pytest.fail(str(exc))
    # The same directory set-up writes: idempotent, so a converted checkout pays nothing here.
    return import_gguf(gguf_path, DEFAULT_TARGET_DIR)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator on the kernel tests' device with a fresh random seed, printed so that a failure can
    be replayed (kernel tests only: it loads the kernels)."""
    import kernel_parity
    from kernel_setup import DEVICE

    generator, seed = kernel_parity.generator(DEVICE)
    print(f"seed={seed}")
    return generator


@pytest.fixture
def cpu_gen(gen: torch.Generator) -> torch.Generator:
    """A CPU generator seeded from `gen` (its printed seed replays both), for a kernel test of a path
    that runs on the CPU whatever the kernel tests' device."""
    import kernel_parity

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=gen.device))
    return kernel_parity.generator(torch.device("cpu"), seed)[0]


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with an 8-token vocabulary (see tests/tiny_models.py)."""
    from tiny_models import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def tiny_drafter_dir(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random DSpark drafter (block size 4) for the tiny target."""
    from tiny_models import write_tiny_drafter

    return write_tiny_drafter(tiny_target_dir, tmp_path_factory.mktemp("tiny-drafter"))


@pytest.fixture(scope="session")
def two_layer_drafter_dir(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer DSpark drafter (block size 4) for the tiny target."""
    from tiny_models import write_tiny_drafter

    path = tmp_path_factory.mktemp("two-layer-drafter")
    return write_tiny_drafter(tiny_target_dir, path, seed=1, num_layers=2)


@pytest.fixture(scope="session")
def anchor_drafter_dir(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random DSpark drafter with an anchor feature (block size 4) for the tiny target."""
    from tiny_models import write_tiny_drafter

    path = tmp_path_factory.mktemp("anchor-drafter")
    return write_tiny_drafter(tiny_target_dir, path, seed=2, anchor_feature=True)


@pytest.fixture(scope="session")
def triton_server(smollm2_dir, tmp_path_factory):
    """One real tritonserver (`dspark serve` on a repository rendered into tmp with test settings)
    for the whole session, on free ports; stopped at the end, leaving no tritonserver or stub."""
    from server_fixtures import start_server

    from dspark.tools.cli import main as dspark_main

    assert dspark_main(["create-draft", "--if-missing"]) == 0
    server = start_server(tmp_path_factory.mktemp("triton"))
    yield server
    status = server.stop()
    leftovers = server.leftover_processes()
    assert status == 0, f"dspark serve did not stop cleanly ({status}):\n{server.log_tail()}"
    assert not leftovers, f"processes outlived the server: {leftovers}"


@pytest.fixture(scope="session")
def smollm2_drafter_dir(smollm2_dir: Path) -> Path:
    """The embedded default's drafter directory (set-up creates a random one until a trained one ships)."""
    from dspark.config import DEFAULT_DRAFT_DIR
    from dspark.runner.models.hf_config import ModelConfig
    from dspark.spec.draft_checkpoint import create_random_drafter, fresh_draft_config, save_drafter

    if not (DEFAULT_DRAFT_DIR / "config.json").is_file():
        save_drafter(
            create_random_drafter(fresh_draft_config(ModelConfig.load(smollm2_dir))), DEFAULT_DRAFT_DIR
        )
    return DEFAULT_DRAFT_DIR
