"""The dspark model with a synthetic token source in place of the engine (benchmarks only).

benchmarks/serving_ceiling.py copies this file as `1/model.py` of a throw-away model repository, with
`synthetic.json` beside it: `{"steps_per_s": S, "tokens_per_step": K}`. The Triton adapter is the
real one (model_repository/dspark/1/model.py, loaded from this checkout); only `_make_engine` is
replaced, by an engine that gives every running request K tokens per step, S steps a second, with no
model behind it. What the serving path sustains then is its own ceiling.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import sys
import threading
import time
from pathlib import Path

from dspark.config import REPO_ROOT, EngineConfig
from dspark.outputs import EngineLoad, RequestDelta, SpecStats
from dspark.tokenizer import Tokenizer

_spec = importlib.util.spec_from_file_location(
    "dspark_model", REPO_ROOT / "model_repository/dspark/1/model.py"
)
_real = importlib.util.module_from_spec(_spec)
sys.modules["dspark_model"] = _real  # dataclasses look their module up while the class is made
_spec.loader.exec_module(_real)

TOKEN_TEXT = " the"


class SyntheticEngine:
    """AsyncEngine's interface; every running request gets `tokens_per_step` tokens per step."""

    def __init__(self, config: EngineConfig, steps_per_s: float, tokens_per_step: int) -> None:
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self._token_id = self.tokenizer.encode(TOKEN_TEXT)[-1]
        self._period = 1.0 / steps_per_s
        self._tokens_per_step = tokens_per_step
        self._inbox: queue.Queue = queue.Queue()
        self._running: dict[str, list] = {}  # id -> [on_delta, params, prompt length, emitted]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="synthetic-engine", daemon=True)
        self.error = None

    @property
    def healthy(self) -> bool:
        """True while the loop runs."""
        return self._thread.is_alive() and not self._stopping.is_set()

    def start(self) -> None:
        """Start the step loop."""
        self._thread.start()

    def submit(self, request_id, params, on_delta, prompt=None, prompt_token_ids=None) -> list[int]:  # noqa: ANN001
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
        self._stopping.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        next_step = time.monotonic()
        while not self._stopping.is_set():
            self._drain()
            if not self._running:
                time.sleep(0.001)
                next_step = time.monotonic()
                continue
            self._step()
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


class TritonPythonModel(_real.TritonPythonModel):
    """The real adapter over the synthetic engine."""

    def initialize(self, args: dict) -> None:
        """Read synthetic.json beside this file, then initialize as the real model does."""
        here = Path(args["model_repository"]) / args["model_version"]
        self._synthetic = json.loads((here / "synthetic.json").read_text())
        super().initialize(args)

    def _make_engine(self, config: EngineConfig, on_death) -> SyntheticEngine:  # noqa: ANN001
        return SyntheticEngine(config, self._synthetic["steps_per_s"], self._synthetic["tokens_per_step"])
