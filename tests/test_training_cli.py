"""The training commands chain into a drafter the engine serves: distill-data -> train-draft ->
calibrate-draft -> eval-acceptance, on the tiny target, and speculation with it stays lossless."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tiny_models import write_tiny_target

from dspark import LLM, EngineConfig, SamplingParams
from dspark.tokenizer import Tokenizer
from dspark.tools.cli import main as dspark
from dspark.training.data import encode_prompt
from dspark.training.shards import read_shard


def _write_prompts(path) -> None:
    """18 prompts, two of each key."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(18):
            words = " ".join(f"w{rng.randrange(1, 8)}" for _ in range(rng.randrange(2, 7)))
            domain = ("chat", "code", "prose")[i % 3]
            f.write(json.dumps({"id": str(i), "domain": domain, "prompt": words, "key": f"k{i // 2}"}) + "\n")


def test_training_commands_produce_a_calibrated_drafter_the_engine_serves(tiny_target_dir, tmp_path) -> None:
    prompts, data, drafter = tmp_path / "prompts.jsonl", tmp_path / "data", tmp_path / "drafter"
    _write_prompts(prompts)
    target = f"--target {tiny_target_dir}"
    commands = [
        f"distill-data {target} --prompts {prompts} --out-dir {data} --max-new-tokens 16 --val-prompts 6 "
        "--responses-per-prompt 2",
        f"train-draft {target} --data {data} --out {drafter} --block-size 4 "
        "--markov-rank 4 --num-target-features 2 --steps 4 --batch-size 4 --anchors 2",
        f"calibrate-draft {target} --draft {drafter} --data {data} --anchors 3 --report {tmp_path}/cal.json",
        f"eval-acceptance --model {tiny_target_dir} --draft-model {drafter} --prompts {prompts} "
        f"--per-domain 2 --max-tokens 8 --block-size 4 --num-kv-pages 128 --out {tmp_path}/eval.json",
    ]
    for command in commands:
        assert dspark(command.split()) == 0, command

    # 6 held-out prompts (whole keys, 2 of each domain) answered once; the other 12 twice, the extra
    # answer sampled.
    shard = read_shard(data / "distill-000.npz")
    val, train = shard.held_out, shard.train
    assert len(val) == 6 and len(train) == 24
    assert sorted(r.domain for r in val) == ["chat", "chat", "code", "code", "prose", "prose"]
    assert all(r.key == f"k{int(r.id) // 2}" for r in val + train)
    assert {r.key for r in val}.isdisjoint(r.key for r in train)
    assert sorted(Counter(r.id for r in train).values()) == [2] * 12
    assert all(max(r.temperature for r in train if r.id == i) == 1.0 for i in {r.id for r in train})
    config = json.loads((drafter / "config.json").read_text())
    report = json.loads((tmp_path / "cal.json").read_text())
    assert config["confidence_temperatures"] == [round(t, 6) for t in report["temperatures"]]
    assert len(report["temperatures"]) == 4 and report["ece_after"] <= report["ece_before"]
    rows = json.loads((tmp_path / "eval.json").read_text())["rows"]
    assert {(r["domain"], r["mode"], r["temperature"]) for r in rows} >= {
        ("all", "compact", 1.0),
        ("code", "static", 0.0),
    }
    assert all(r["steps"] > 0 and r["tau"] >= 1.0 for r in rows)

    base = EngineConfig(
        model=str(tiny_target_dir),
        draft_model=str(drafter),
        num_kv_pages=64,
        kv_page_size=4,
        adaptive_speculation=False,
    )
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt_ids = [[3, 4, 5], [6, 1]]
    plain = LLM(base.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompt_ids)
    spec = LLM(base.replace(spec_mode="compact")).generate(params=params, prompt_token_ids=prompt_ids)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_run_dspark_script_maps_the_checkout_and_runs_a_command() -> None:
    """training/run_dspark.py (how the GPU scripts call `dspark` without installing it) maps the
    checkout's packages and runs a command (it failed at its start when the kernels package moved)."""
    root = Path(__file__).resolve().parents[1]
    script = (
        "import runpy, sys; sys.argv = ['run_dspark.py', 'import-gguf', '--help']; "
        f"runpy.run_path({str(root / 'training' / 'run_dspark.py')!r}, run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--gguf" in done.stdout


def test_the_gpu_scripts_join_gguf_parts_carried_now_and_parked_before(tmp_path) -> None:
    """training/lib.sh's import_target joins the GGUF from its parts wherever each one is: the working
    call carries the last part in a subfolder of .carry/ while earlier calls parked the others (in
    /tmp/carry on the device); it joined the lone part in .carry/c4 and failed its checksum."""
    root = Path(__file__).resolve().parents[1]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    content = bytes(range(256)) * 40
    chunks = [content[i : i + 3000] for i in range(0, len(content), 3000)]
    for index, chunk in enumerate(chunks):
        folder = tmp_path / (".carry/c4" if index == len(chunks) - 1 else "parked")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.part-{index:02d}").write_bytes(chunk)
    (tmp_path / ".carry" / "c4" / f"{name}.sha256").write_text(hashlib.sha256(content).hexdigest() + "\n")
    script = (
        f"ROOT={tmp_path}; PARKED={tmp_path / 'parked'}; PY=true; GGUF=''; START=$(date +%s); "
        f"source {root / 'training' / 'lib.sh'}; "
        'dspark() { echo "dspark $*"; }; import_target'
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / ".carry" / name).read_bytes() == content
    assert f"dspark import-gguf --gguf {tmp_path / '.carry' / name}" in done.stdout


def test_distill_data_sends_its_raw_share_of_training_prompts_without_the_template(tmp_path) -> None:
    # w1 opens a turn, w0 closes it, w2 opens the answer: a chat prompt starts with w1, a raw one does not.
    target = write_tiny_target(tmp_path / "target", vocab_size=64, seed=2)
    config = json.loads((target / "tokenizer_config.json").read_text())
    template = (
        "{% for m in messages %}w1 {{ m['content'] }} w0 {% endfor %}"
        "{% if add_generation_prompt %}w2 {% endif %}"
    )
    (target / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    tokenizer = Tokenizer.from_dir(target)
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts)
    texts = {json.loads(line)["id"]: json.loads(line)["prompt"] for line in prompts.read_text().splitlines()}
    forms: dict[float, Counter[str]] = {}
    for share in (0.0, 0.5, 1.0):
        out = tmp_path / f"data-{share}"
        command = f"distill-data --target {target} --prompts {prompts} --out-dir {out} --max-new-tokens 4 "
        assert dspark([*command.split(), "--val-prompts", "6", "--raw-share", str(share)]) == 0
        shard = read_shard(out / "distill-000.npz")
        # Held-out prompts stay chat whatever the share: the calibration judges the shipped form.
        assert all(r.prompt_ids == encode_prompt(tokenizer, texts[r.id]) for r in shard.held_out)
        forms[share] = Counter()
        for record in shard.train:
            raw = record.prompt_ids == encode_prompt(tokenizer, texts[record.id], "raw")
            assert raw or record.prompt_ids == encode_prompt(tokenizer, texts[record.id])
            forms[share]["raw" if raw else "chat"] += 1
    assert forms[0.0] == Counter(chat=12) and forms[1.0] == Counter(raw=12)
    assert forms[0.5]["raw"] > 0 and forms[0.5]["chat"] > 0
    with pytest.raises(SystemExit):
        dspark(
            f"distill-data --target {target} --prompts {prompts} --out-dir {tmp_path}/x --raw-share 2".split()
        )


def test_a_drafter_trained_over_a_draft_vocabulary_is_served_and_calibrated_over_it(
    tiny_target_dir, tmp_path
) -> None:
    from dspark.spec.draft_vocab import load_draft_vocab, read_draft_vocab_order

    prompts, data = tmp_path / "prompts.jsonl", tmp_path / "data"
    first, second = tmp_path / "first", tmp_path / "second"
    _write_prompts(prompts)
    target = f"--target {tiny_target_dir}"
    train = f"train-draft {target} --data {data} --block-size 4 --markov-rank 4 --num-target-features 2 "
    train += "--steps 3 --batch-size 4 --anchors 2"
    commands = [
        f"distill-data {target} --prompts {prompts} --out-dir {data} --max-new-tokens 12 --val-prompts 6",
        # No drafter to take an order from: the data's own frequencies, the 5 most frequent tokens.
        f"{train} --out {first} --draft-vocab-size 5",
        # Warm from it over its own draft vocabulary (0: the size its file names).
        f"{train} --out {second} --init-draft {first} --draft-vocab-size 0",
        f"calibrate-draft {target} --draft {second} --data {data} --anchors 3 --report {tmp_path}/cal.json",
    ]
    for command in commands:
        assert dspark(command.split()) == 0, command
    order, default = read_draft_vocab_order(first, 8)
    assert default == 5
    eos = Tokenizer.from_dir(tiny_target_dir).eos_token_ids
    assert set(eos) <= set(order[: len(eos)].tolist())  # the end-of-sequence tokens are always drafted
    # The same order and size travel on; the engine drafts from those 5 tokens by default.
    again, again_default = read_draft_vocab_order(second, 8)
    assert again_default == 5 and again.tolist() == order.tolist()
    assert load_draft_vocab(second, 0, 8).tolist() == sorted(order[:5].tolist())
    assert json.loads((tmp_path / "cal.json").read_text())["num_blocks"] > 0

    base = EngineConfig(
        model=str(tiny_target_dir), draft_model=str(second), num_kv_pages=64, kv_page_size=4,
        adaptive_speculation=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt_ids = [[3, 4, 5], [6, 1]]
    plain = LLM(base.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompt_ids)
    spec = LLM(base.replace(spec_mode="static")).generate(params=params, prompt_token_ids=prompt_ids)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    with pytest.raises(SystemExit, match="draft_vocab"):
        dspark(f"{train} --out {tmp_path}/third --draft-vocab-size 4 --draft-vocab-from {data}".split())
