"""dspark-client bench's prompts: the built-in questions or a file's, sent in turn."""

from __future__ import annotations

import threading

import pytest

from dspark_client.bench import run_level
from dspark_client.prompts import PROMPTS, read_prompts


def test_read_prompts_takes_jsonl_objects_or_lines(tmp_path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a b"}\n\n{"id": 1, "prompt": "c"}\n')
    assert read_prompts(jsonl) == ["a b", "c"]
    text = tmp_path / "p.txt"
    text.write_text("first question?\n\n  second one\n")
    assert read_prompts(text) == ["first question?", "  second one"]
    for bad in ('{"prompt": 3}\n', '["a"]\n', "not json\n", '{"prompt": ""}\n'):
        jsonl.write_text('{"prompt": "ok"}\n' + bad)
        with pytest.raises(ValueError, match="p.jsonl:2"):
            read_prompts(jsonl)
    text.write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(text)


class _Recorder:
    """A streamer that records the prompts it was asked to send and streams nothing."""

    sent: list[str] = []
    lock = threading.Lock()

    def __call__(self, prompt: str):
        with self.lock:
            self.sent.append(prompt)
        return iter(())

    def close(self) -> None:
        pass


def test_a_level_sends_the_given_prompts_in_turn() -> None:
    _Recorder.sent = []
    result = run_level(2, 5, _Recorder, ["x", "y", "z"])
    assert sorted(_Recorder.sent) == ["x", "x", "y", "y", "z"]
    _Recorder.sent = []
    run_level(1, 9, _Recorder)
    assert _Recorder.sent == [PROMPTS[i % len(PROMPTS)] for i in range(9)]
    assert result.num_requests == 5
