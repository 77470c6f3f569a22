"""Self-distillation data accumulates across runs: shards hold exactly the records written (older shards
without keys, older JSON-lines files and the shards of earlier runs still load), the union of several counts
each response once and never trains on a prompt or key any of them holds out, every run holds out the same
prompts, whole keys, each domain its share, and a drafter trained on top of another carries the whole
training log. distill-data writes its shards while it runs (a run killed keeps them) and ends by its
deadline."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.runner.models.loader import load_target_model
from dspark.tools.cli import main as dspark
from dspark.training.data import DistillRecord, distill, write_records
from dspark.training.shards import (
    DistillData,
    ShardWriter,
    read_data,
    read_shard,
    write_shard,
    write_shards,
)


@pytest.fixture(scope="module")
def records(tiny_target_dir) -> list[DistillRecord]:
    """Twelve responses of the tiny target, half greedy, half sampled, with sources."""
    rng = random.Random(0)
    prompts = [
        (f"p{i}", "chat", [rng.randrange(1, 8) for _ in range(rng.randrange(2, 8))]) for i in range(12)
    ]
    out = distill(load_target_model(tiny_target_dir), prompts, [0.0, 1.0] * 6, [], 16, 12, seed=0)
    for record in out:
        record.source = f"doc{int(record.id[1:]) % 3}"
    return out


def _write_prompts(path, count: int = 18) -> None:
    """Prompts q0.. of sources s0..s3; the first 15 in five keys of three prompts, the rest without a key."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(count):
            words = " ".join(f"w{rng.randrange(1, 8)}" for _ in range(rng.randrange(2, 7)))
            row = {"id": f"q{i}", "domain": "chat", "prompt": words, "source": f"s{i % 4}"}
            f.write(json.dumps({**row, "key": f"k{i % 5}"} if i < 15 else row) + "\n")


def _prompt_key(prompt_id: str) -> str:
    """The key `_write_prompts` gives a prompt: k0..k4, or its id."""
    i = int(prompt_id[1:])
    return f"k{i % 5}" if i < 15 else prompt_id


def _as_version_1(path: Path) -> None:
    """Rewrite a shard as format 1 wrote it: no prompt keys."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files if name != "prompt_key"}
    arrays["format_version"] = np.array(1, dtype=np.int32)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_LZMA) as archive:
        for name, array in arrays.items():
            with archive.open(name + ".npy", "w") as f:
                np.lib.format.write_array(f, array, allow_pickle=False)


def test_a_shard_reads_back_the_records_written(records, tmp_path) -> None:
    # Large token ids too: a shard stores uint16 when every id fits, int32 otherwise.
    big = DistillRecord("big", "code", 0.7, [70000, 3], [65535, 2**20], "src", "src#key")
    path = write_shard(tmp_path / "a.npz", records[2:] + [big], records[:2], {"seed": 3})
    back = read_shard(path)
    assert back.train == records[2:] + [big] and back.train[-1].key == "src#key"
    assert back.held_out == records[:2]


def test_a_shard_without_keys_reads_back_with_ids_as_keys(records, tmp_path) -> None:
    keyed = [replace(r, key=f"doc-{r.id}") for r in records]
    path = write_shard(tmp_path / "old.npz", keyed[2:], keyed[:2], {})
    _as_version_1(path)
    back = read_shard(path)
    assert back.train == records[2:] and back.held_out == records[:2]
    assert all(r.key == r.id for r in back.train + back.held_out)


def test_shards_split_by_stored_tokens_and_keep_held_out_records_in_the_first(records, tmp_path) -> None:
    data = DistillData(records[2:], records[:2])
    limit = max(len(r.token_ids) for r in records) * 3
    paths = write_shards(tmp_path, "run7", data, {}, max_tokens=limit)
    assert len(paths) > 2 and [p.name for p in paths][:2] == ["run7-000.npz", "run7-001.npz"]
    shards = [read_shard(p) for p in paths]
    assert shards[0].held_out == records[:2] and not any(s.held_out for s in shards[1:])
    assert [r for s in shards for r in s.train] == records[2:]
    assert all(sum(len(r.token_ids) for r in s.train + s.held_out) <= limit for s in shards)


def test_the_union_of_shards_counts_each_response_once_and_never_trains_on_held_out_prompts(
    records, tmp_path
) -> None:
    first = write_shard(tmp_path / "a" / "first.npz", records[2:8], records[:1], {})
    # The second run answered some prompts identically (duplicates), one differently (a new response),
    # and trained on a prompt the first run held out: that response must not be trained on.
    changed = DistillRecord(**{**records[5].__dict__, "response_ids": [*records[5].response_ids, 7]})
    leaked = DistillRecord(**{**records[0].__dict__, "temperature": 1.0, "response_ids": [5, 5, 5]})
    write_shard(tmp_path / "b" / "second.npz", [*records[6:12], changed, leaked], records[1:2], {})
    union = read_data([first, tmp_path / "b"])
    key = lambda r: (r.id, r.temperature, r.response_ids)  # noqa: E731
    assert sorted(map(key, union.train)) == sorted(map(key, [*records[2:12], changed]))
    assert sorted(map(key, union.held_out)) == sorted(map(key, records[:2]))
    assert {r.id for r in union.held_out}.isdisjoint(r.id for r in union.train)
    # The order does not depend on the order of the inputs.
    assert read_data([tmp_path / "b", first]) == union


def test_the_union_never_trains_on_a_key_any_input_holds_out(records, tmp_path) -> None:
    doc = [replace(r, key="doc") for r in records[:3]]
    other = [replace(r, key=f"other{i}") for i, r in enumerate(records[3:6])]
    first = write_shard(tmp_path / "first.npz", other, doc[:1], {})
    # Another call trained on the held-out prompt's document (other prompts of its key): dropped.
    second = write_shard(tmp_path / "second.npz", doc[1:], [], {})
    # A shard without keys held out records[6]; a later call knows its key and trained on that key.
    old = write_shard(tmp_path / "old.npz", [], records[6:7], {})
    _as_version_1(old)
    later = [replace(r, key="doc6") for r in (records[6], records[7])]
    third = write_shard(tmp_path / "third.npz", [*later, records[8]], [], {})
    union = read_data([first, second, old, third])
    assert sorted(r.id for r in union.train) == sorted(r.id for r in [*other, records[8]])
    assert {r.key for r in union.held_out} == {"doc", "doc6"}
    assert {r.key for r in union.held_out}.isdisjoint(r.key for r in union.train)


def test_every_run_holds_out_the_same_prompts_and_writes_them_as_shards(tiny_target_dir, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts)
    runs = []
    for seed, count in ((0, 0), (1, 10)):
        out = tmp_path / f"seed{seed}"
        command = (
            f"distill-data --target {tiny_target_dir} --prompts {prompts} --out-dir {out} --max-new-tokens 8 "
            f"--val-prompts 4 --num-prompts {count} --seed {seed} --shard-name s{seed}"
        )
        assert dspark(command.split()) == 0
        # One shard, and nothing else: the responses are in no JSON-lines file any more.
        assert sorted(p.name for p in out.iterdir()) == [f"s{seed}-000.npz"]
        shard = read_shard(out / f"s{seed}-000.npz")
        assert all(r.source == f"s{int(r.id[1:]) % 4}" for r in shard.train + shard.held_out)
        assert all(r.key == _prompt_key(r.id) for r in shard.train + shard.held_out)
        runs.append(shard)
    # At least 4 prompts held out, as whole keys: every prompt of a held-out key, none of it trained on.
    held_keys = {r.key for r in runs[0].held_out}
    assert len(runs[0].held_out) >= 4
    assert sorted(r.id for r in runs[0].held_out) == sorted(
        f"q{i}" for i in range(18) if _prompt_key(f"q{i}") in held_keys
    )
    assert {r.id for r in runs[0].held_out} == {r.id for r in runs[1].held_out}
    # Another seed, other training prompts: the runs differ, their held-out prompts do not.
    assert {r.id for r in runs[0].train} != {r.id for r in runs[1].train}


def test_no_key_has_prompts_on_both_sides(tiny_target_dir, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts)
    for val in (1, 5):
        out = tmp_path / f"val{val}"
        command = (
            f"distill-data --target {tiny_target_dir} --prompts {prompts} --out-dir {out} --max-new-tokens 4 "
            f"--val-prompts {val} --responses-per-prompt 2"
        )
        assert dspark(command.split()) == 0
        # The prompt file's keys, not the ones the records carry: those could be wrong too.
        shard = read_shard(out / "distill-000.npz")
        sides = [{_prompt_key(r.id) for r in side} for side in (shard.train, shard.held_out)]
        assert sides[0] and sides[1] and sides[0].isdisjoint(sides[1]), (val, sides)
        union = read_data([out])
        assert {_prompt_key(r.id) for r in union.held_out}.isdisjoint(_prompt_key(r.id) for r in union.train)


def _write_domain_prompts(path: Path, seed: int) -> dict[str, tuple[str, str]]:
    """24 prompts in a shuffled order: chat 12 of one-prompt keys, code 6 in 3 keys, math 6 in 2 keys (as
    the real set's few large math modules); {id: (domain, key)}."""
    layout = [("chat", f"chat{i}") for i in range(12)]
    layout += [("code", f"code{i // 2}") for i in range(6)] + [("math", f"math{i // 3}") for i in range(6)]
    rng = random.Random(seed)
    words = [f"w{rng.randrange(1, 8)} w{i % 7 + 1}" for i in range(len(layout))]
    rows = [
        {"id": f"{domain}-{i}", "domain": domain, "prompt": words[i], "key": key}
        for i, (domain, key) in enumerate(layout)
    ]
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {row["id"]: (row["domain"], row["key"]) for row in rows}


def test_every_domain_holds_out_its_lowest_hash_keys_up_to_its_share(tiny_target_dir, tmp_path) -> None:
    # The 4 keys of lowest hash overall hold no code prompt; each domain choosing its own holds out some.
    def key_hash(key: str) -> tuple[int, str]:
        return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big"), key

    held = []
    for seed, count in ((0, 0), (1, 12)):
        prompts, out = tmp_path / f"prompts{seed}.jsonl", tmp_path / f"seed{seed}"
        layout = _write_domain_prompts(prompts, seed)
        command = (
            f"distill-data --target {tiny_target_dir} --prompts {prompts} --out-dir {out} --max-new-tokens 4 "
            f"--val-prompts 4 --num-prompts {count} --seed {seed}"
        )
        assert dspark(command.split()) == 0
        shard = read_shard(out / "distill-000.npz")
        sides = [[layout[r.id] for r in side] for side in (shard.train, shard.held_out)]
        train_keys, held_keys = ({key for _, key in side} for side in sides)
        assert train_keys.isdisjoint(held_keys)
        # Whole keys: every prompt of a held-out key is held out.
        assert sorted(sides[1]) == sorted(v for v in layout.values() if v[1] in held_keys)
        assert {domain for domain, _ in sides[1]} == {"chat", "code", "math"}
        # Shares of 4 by prompt count: chat 2, code 1, math 1 (a key of 3, larger than its share, whole).
        per_domain = {d: sum(domain == d for domain, _ in sides[1]) for d in ("chat", "code", "math")}
        assert per_domain == {"chat": 2, "code": 2, "math": 3}
        for domain in per_domain:
            keys = sorted({key for d, key in layout.values() if d == domain}, key=key_hash)
            chosen = [key for key in keys if key in held_keys]
            assert chosen == keys[: len(chosen)], (domain, chosen, keys)
        held.append(sorted(held_keys))
    # Another seed, prompt count and file order: the same keys.
    assert held[0] == held[1]


def test_training_on_top_of_a_drafter_continues_its_log_at_a_lower_peak(
    tiny_target_dir, records, tmp_path
) -> None:
    data = write_shard(tmp_path / "data" / "d.npz", records[2:], records[:2], {})
    target = f"--target {tiny_target_dir}"
    common = (
        f"--data {data} --block-size 4 --markov-rank 4 --num-target-features 2 --batch-size 4 --anchors 2"
    )
    first, second = tmp_path / "first", tmp_path / "second"
    assert (
        dspark(f"train-draft {target} {common} --out {first} --steps 2 --log-every 1 --lr 1e-3".split()) == 0
    )
    continued = f"--out {second} --init-draft {first} --steps 3 --log-every 1 --lr 1e-3 --lr-run-decay 0.5"
    assert dspark(f"train-draft {target} {common} {continued}".split()) == 0
    log = [json.loads(line) for line in (second / "train_log.jsonl").read_text().splitlines()]
    assert [(e["run"], e["step"]) for e in log] == [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    assert log[:2] == [json.loads(line) for line in (first / "train_log.jsonl").read_text().splitlines()]
    assert max(e["lr"] for e in log[2:]) <= 0.5e-3


def _wait_for(condition, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_shard_writer_writes_complete_shards_while_records_still_come(records, tmp_path) -> None:
    limit = max(len(r.token_ids) for r in records) * 3
    writer = ShardWriter(
        tmp_path / "live", "run", {"seed": 1}, max_tokens=limit, every_seconds=0.0, log=False
    )
    for record in records[:2]:
        writer.add(record, held_out=True)
    writer.add(records[2])
    # Before the writer is closed, a complete shard holds everything added.
    _wait_for(lambda: writer.num_written == 3)
    first = read_shard(tmp_path / "live" / "run-000.npz")
    assert first.held_out == records[:2] and first.train == records[2:3]
    for record in records[3:]:
        writer.add(record)
    paths = writer.close()
    assert [p.name for p in paths] == [f"run-{i:03d}.npz" for i in range(len(paths))] and len(paths) > 2
    assert not list((tmp_path / "live").glob("*.tmp"))
    # The same shards as written at once (held-out records first, then in order), array for array where
    # no held-out record changes the order of a file's responses.
    at_once = write_shards(
        tmp_path / "once", "run", DistillData(records[2:], records[:2]), {"seed": 1}, limit
    )
    assert [p.name for p in at_once] == [p.name for p in paths]
    assert [read_shard(p) for p in paths] == [read_shard(p) for p in at_once]
    for mine, theirs in zip(paths[1:], at_once[1:], strict=True):
        with np.load(mine) as a, np.load(theirs) as b:
            assert a.files == b.files
            assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a.files)


def test_a_shard_writer_rewrites_the_open_shard_at_most_every_so_often(records, tmp_path) -> None:
    writer = ShardWriter(tmp_path, "slow", {}, every_seconds=3600.0, log=False)
    for record in records:
        writer.add(record)
    time.sleep(0.3)
    assert not (tmp_path / "slow-000.npz").exists()
    assert writer.close_seconds() > 0
    assert writer.close() == [tmp_path / "slow-000.npz"]
    assert read_shard(tmp_path / "slow-000.npz").train == records
    # Nothing added: one empty shard, as a run that answered nothing has always left.
    assert read_shard(ShardWriter(tmp_path, "none", {}, log=False).close()[0]) == DistillData([], [])


def test_a_shard_writer_that_fails_says_so(records, tmp_path) -> None:
    (tmp_path / "taken").write_text("a file where the shards' folder should be")
    writer = ShardWriter(tmp_path / "taken", "x", {}, every_seconds=0.0, log=False)
    writer.add(records[0])
    with pytest.raises(RuntimeError, match="writing x failed"):
        _wait_for(lambda: writer._error is not None)
        writer.add(records[1])
    with pytest.raises(RuntimeError, match="writing x failed"):
        writer.close()


def test_older_json_lines_data_still_reads(records, tmp_path) -> None:
    write_records(tmp_path / "old" / "distill_train.jsonl", records[2:])
    write_records(tmp_path / "old" / "distill_val.jsonl", records[:2])
    union = read_data([tmp_path / "old"])
    key = lambda r: (r.id, r.temperature, r.response_ids)  # noqa: E731
    assert sorted(map(key, union.train)) == sorted(map(key, records[2:]))
    assert sorted(map(key, union.held_out)) == sorted(map(key, records[:2]))


CARRIED = sorted((Path(__file__).resolve().parents[1] / ".carry" / "distill").glob("*.npz"))


@pytest.mark.skipif(not CARRIED, reason="no shards of earlier runs in .carry/distill")
def test_the_shards_of_earlier_runs_still_load() -> None:
    data = read_data(CARRIED)
    assert data.train and data.held_out
    assert {r.temperature for r in data.train} == {0.0, 1.0}
    assert all(r.response_ids and r.prompt_ids for r in data.train[:1000])


def _distill_command(target, prompts, out, *extra: str) -> list[str]:
    return [
        "distill-data",
        "--target",
        str(target),
        "--prompts",
        str(prompts),
        "--out-dir",
        str(out),
        "--device",
        "cpu",
        "--max-new-tokens",
        "48",
        "--batch-size",
        "8",
        "--val-prompts",
        "6",
        "--phase-answers",
        "16",
        *extra,
    ]


def test_a_killed_distill_run_keeps_the_shards_it_wrote(tiny_target_dir, tmp_path) -> None:
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    _write_prompts(prompts, 4000)
    command = _distill_command(
        tiny_target_dir, prompts, out, "--checkpoint-seconds", "0.2", "--shard-max-tokens", "3000"
    )
    run = "import sys; from dspark.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see test_training_feed's one_thread
    process = subprocess.Popen([sys.executable, "-c", run, *command], stderr=subprocess.DEVNULL, env=env)
    try:
        # Killed without warning once a second shard is there (the first one full and closed).
        _wait_for(lambda: (out / "distill-001.npz").exists() or process.poll() is not None, 120.0)
        assert process.poll() is None, "the run ended before it was killed: give it more work"
        process.kill()
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
    data = read_data([out])
    shards = sorted(out.glob("*.npz"))
    assert len(shards) >= 2 and all(read_shard(p) for p in shards)
    # The held-out prompts went first; the training answers came as they were answered, both kinds.
    assert len(data.held_out) >= 6 and len(data.train) > 50
    assert {r.temperature for r in data.train} == {0.0, 1.0}


@pytest.fixture
def one_thread():
    """Torch on one thread while a test times things (see test_training_feed's one_thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_distill_data_ends_by_its_deadline_with_its_shards_written(
    tiny_target_dir, tmp_path, one_thread
) -> None:
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    _write_prompts(prompts, 4000)
    began = time.monotonic()
    # 6 s, the engine's start and the last shard's write included; unbounded, the run would take minutes.
    assert dspark(_distill_command(tiny_target_dir, prompts, out, "--max-minutes", "0.1")) == 0
    assert time.monotonic() - began < 6.0 + 0.5
    shard = read_shard(out / "distill-000.npz")
    assert len(shard.held_out) >= 6 and 100 < len(shard.train) < 4000 - 6
    # About half of the training answers sampled (--sample-fraction 0.5), within a phase.
    sampled = sum(r.temperature == 1.0 for r in shard.train)
    assert abs(sampled - len(shard.train) / 2) <= 16 + 0.1 * len(shard.train)
