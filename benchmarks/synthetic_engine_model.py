"""The dspark model with a synthetic token source in place of the engine (benchmarks only).

benchmarks/serving_ceiling.py copies this file as `1/model.py` of a throw-away model repository, with
`synthetic.json` beside it: `{"steps_per_s": S, "tokens_per_step": K, "engine_process": P}`. The
Triton adapter is the real one (model_repository/dspark/1/model.py, loaded from this checkout); only
`_make_engine` is replaced, by an engine that gives every running request K tokens per step, S steps a
second, with no model behind it (`"busy_share": B`: the loop holds the GIL, computing, for that share
of each step's period and sleeps the rest, as a host-bound engine loop on a GPU does). With P true (the
default, as served) that engine runs in its own process behind the real `EngineProcess` (its pipes,
batches, intake and dispatch); with P false, as a thread of the backend stub. What the serving path
sustains then is its own ceiling.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace


def _checkout_first() -> None:
    """`dspark` and the adapter from the checkout that rendered this repository (synthetic.json's
    `repo_root`), ahead of the environment's install, so that a before/after pair of runs from two
    checkouts (a `git worktree`) measures each one's own code; its engine process inherits the path."""
    here = Path(__file__).resolve().parent / "synthetic.json"
    root = json.loads(here.read_text()).get("repo_root") if here.is_file() else None
    if root and str(Path(root) / "backend") not in sys.path:
        sys.path.insert(0, str(Path(root) / "backend"))


_checkout_first()

from dspark.config import REPO_ROOT, EngineConfig  # noqa: E402
from dspark.outputs import EngineLoad, RequestDelta, SpecStats  # noqa: E402
from dspark.tokenizer import Tokenizer  # noqa: E402

TOKEN_TEXT = " the"
MODULE_NAME = "synthetic_engine_model"  # what the engine process imports this file as


class SyntheticEngine:
    """AsyncEngine's interface; every running request gets `tokens_per_step` tokens per step."""

    def __init__(
        self,
        config: EngineConfig,
        steps_per_s: float,
        tokens_per_step: int,
        on_death=None,  # noqa: ANN001 - AsyncEngine's arguments, as EngineProcess passes them
        after_step=None,  # noqa: ANN001
        busy_share: float = 0.0,
        intake=None,  # noqa: ANN001
    ) -> None:
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        # What engine_main reads of an AsyncEngine's engine.
        self.engine = SimpleNamespace(
            model_config=SimpleNamespace(vocab_size=self.tokenizer.vocab_size),
            limits=SimpleNamespace(max_model_len=config.max_model_len or 8192),
        )
        self._after_step = after_step
        self._intake = intake
        self._token_id = self.tokenizer.encode(TOKEN_TEXT)[-1]
        self._period = 1.0 / steps_per_s
        self._busy_s = busy_share * self._period
        self._tokens_per_step = tokens_per_step
        self._inbox: queue.Queue = queue.Queue()
        self._running: dict[str, list] = {}  # id -> [on_delta, params, prompt length, emitted]
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.error = None

    @property
    def healthy(self) -> bool:
        """True while the loop runs (or is about to, in the thread it is bound to)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def start(self) -> None:
        """Start the step loop in a thread of its own."""
        self._thread = threading.Thread(target=self._loop, name="synthetic-engine", daemon=True)
        self._thread.start()

    def bind_to_current_thread(self) -> None:
        """The loop will run in this thread, by `run` (as the engine process runs AsyncEngine's)."""
        self._thread = threading.current_thread()

    def run(self) -> None:
        """Run the step loop here until `stop`."""
        self._loop()

    def stop(self) -> None:
        """Ask the loop to end."""
        self._stopping.set()

    def submit(
        self, request_id, params, on_delta, prompt=None, prompt_token_ids=None, submitted_at=None
    ) -> list[int]:  # noqa: ANN001
        """Queue a request (tokenized here, as the real engine does)."""
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenizer.encode(prompt)
        self._inbox.put(("add", request_id, params, on_delta, len(ids)))
        return ids

    def abort(self, request_id: str) -> None:
        """End a request at the next step with reason abort."""
        self._inbox.put(("abort", request_id))

    def load(self) -> EngineLoad:
        """Running requests (no KV cache here)."""
        return EngineLoad(len(self._running), 0, 0, 0)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything and stop."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        next_step = time.monotonic()
        while not self._stopping.is_set():
            if self._intake is not None:
                self._intake(0.001 if not self._running else 0.0)
            self._drain()
            if not self._running:
                if self._intake is None:
                    time.sleep(0.001)
                next_step = time.monotonic()
                continue
            self._step()
            if self._after_step is not None:
                self._after_step()
            _hold_gil(self._busy_s)
            next_step += self._period
            time.sleep(max(0.0, next_step - time.monotonic()))
        for request_id, (on_delta, _, prompt_len, emitted) in list(self._running.items()):
            on_delta(RequestDelta(request_id, [], "", True, "abort", prompt_len, emitted, SpecStats()))

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, request_id, params, on_delta, prompt_len = item
                self._running[request_id] = [on_delta, params, prompt_len, 0]
            elif item[1] in self._running:
                on_delta, _, prompt_len, emitted = self._running.pop(item[1])
                on_delta(RequestDelta(item[1], [], "", True, "abort", prompt_len, emitted, SpecStats()))

    def _step(self) -> None:
        for request_id, state in list(self._running.items()):
            on_delta, params, prompt_len, emitted = state
            count = min(self._tokens_per_step, params.max_tokens - emitted)
            state[3] = emitted = emitted + count
            finished = emitted >= params.max_tokens
            if finished:
                del self._running[request_id]
            on_delta(
                RequestDelta(
                    request_id,
                    [self._token_id] * count,
                    TOKEN_TEXT * count,
                    finished,
                    "length" if finished else None,
                    prompt_len,
                    emitted,
                    SpecStats(),
                )
            )


def _hold_gil(seconds: float) -> None:
    """Compute in Python (the GIL held but for the interpreter's forced switches) for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


class SyntheticFactory:
    """Builds the engine in the engine process (picklable: this module, by file, and the settings)."""

    def __init__(self, steps_per_s: float, tokens_per_step: int, busy_share: float = 0.0) -> None:
        self.path = str(Path(__file__).resolve())
        self.steps_per_s = steps_per_s
        self.tokens_per_step = tokens_per_step
        self.busy_share = busy_share

    def __reduce__(self) -> tuple:
        return (_factory_in_child, (self.path, self.steps_per_s, self.tokens_per_step, self.busy_share))

    def __call__(self, config: EngineConfig, on_death, after_step, intake=None) -> SyntheticEngine:  # noqa: ANN001
        return SyntheticEngine(
            config, self.steps_per_s, self.tokens_per_step, on_death, after_step, self.busy_share, intake
        )


def _factory_in_child(path: str, steps_per_s: float, tokens_per_step: int, busy_share: float):  # noqa: ANN202
    """Unpickling in the engine process: its SyntheticFactory, from this file (not importable there
    by name: the stub loads it as model.py from a throw-away repository)."""
    module = sys.modules.get(MODULE_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE_NAME] = module
        spec.loader.exec_module(module)
    return module.SyntheticFactory(steps_per_s, tokens_per_step, busy_share)


def _load_real_model():  # noqa: ANN202
    """The real adapter's module (inside the backend stub only: it needs triton_python_backend_utils)."""
    spec = importlib.util.spec_from_file_location(
        "dspark_model", REPO_ROOT / "model_repository/dspark/1/model.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["dspark_model"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


try:
    import triton_python_backend_utils  # noqa: F401
except ImportError:  # the engine process, which needs SyntheticEngine alone
    _real = None
else:
    _real = _load_real_model()


class _Absent:
    pass


class TritonPythonModel(_real.TritonPythonModel if _real is not None else _Absent):
    """The real adapter over the synthetic engine."""

    def initialize(self, args: dict) -> None:
        """Read synthetic.json beside this file, then initialize as the real model does."""
        here = Path(args["model_repository"]) / args["model_version"]
        self._synthetic = json.loads((here / "synthetic.json").read_text())
        super().initialize(args)

    def _make_engine(self, config: EngineConfig, on_death):  # noqa: ANN001, ANN202
        factory = SyntheticFactory(
            self._synthetic["steps_per_s"],
            self._synthetic["tokens_per_step"],
            self._synthetic.get("busy_share", 0.0),
        )
        if self._synthetic.get("engine_process", True):
            from dspark.serving.engine_process import EngineProcess

            return EngineProcess(config, on_death=on_death, engine_factory=factory)
        return factory(config, on_death, None)
