"""Properties of dspark.tokenizer: streamed text equals the non-streamed text, and stop strings never leak."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dspark.engine.output_processor import OutputProcessor, PendingDelta
from dspark.outputs import merge_deltas
from dspark.sampling_params import SamplingParams
from dspark.sequence import Sequence
from dspark.tokenizer import (
    ChatTemplateError,
    DeltaText,
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Training text mixes ASCII with 2-, 3- and 4-byte UTF-8 so that some characters become single
# tokens and others (rarer emoji, CJK) stay split across byte tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "Café, naïve, façade, jalapeño, Übermäßig große Straße.",
    "Привет, мир! Как дела?",
    "日本語のテキストも少し入れます。東京は大きい。",
    "Emoji: 😀 😀 😀 🚀 🎉 👍🏽 and a family 👨‍👩‍👧 in one grapheme.",
    "Numbers 12345 and symbols ∑ ∫ √ ≠ ≤ ≥ → ← ✓.",
]

# Text the tokenizer has rarely or never seen: its multi-byte characters are split across tokens.
SAMPLE_TEXTS = [
    "Hello world! 😀🚀 quick fox",
    "naïve café 🎉🎉 über Straße",
    "東京で🍣を食べた。美味しい！🥢",
    "mixed: Привет 👋🏿 日本 ∑√ 🧪🧬 done",
    "🦀🦀🦀🦀",
]

SMOLLM_DIR = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"


def _train_tokenizer() -> HFTokenizer:
    """A tiny byte-level BPE in the GPT-2 style (what SmolLM2 and Llama 3 use)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model dir: tokenizer.json, tokenizer_config.json (chat template), generation_config.json."""
    root = tmp_path_factory.mktemp("tiny_model")
    hf = _train_tokenizer()
    hf.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML_TEMPLATE,
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>", "special": True},
                "unk_token": "<|endoftext|>",
            }
        )
    )
    # generation_config lists <|endoftext|> only; the union must also contain <|im_end|>.
    (root / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [hf.token_to_id("<|endoftext|>")]})
    )
    (root / "config.json").write_text(json.dumps({"eos_token_id": 9999, "bos_token_id": 9998}))
    return root


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    """The tiny tokenizer loaded through Tokenizer.from_dir."""
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def rng() -> random.Random:
    """Fresh randomness each run; the seed is printed so a failure can be replayed."""
    seed = random.SystemRandom().randrange(2**32)
    print(f"rng seed {seed}")
    return random.Random(seed)


def _random_split(ids: list[int], rng: random.Random) -> list[list[int]]:
    """Cut `ids` into consecutive chunks of 1..8 tokens (a DSpark step commits up to block_size + 1)."""
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 8)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def _stream(tokenizer: Tokenizer, prompt: list[int], chunks: list[list[int]]) -> list[str]:
    """Every piece of text the detokenizer emits for these chunks, flush included."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    return [detok.push(chunk) for chunk in chunks] + [detok.flush()]


def _split_chars(text: str, rng: random.Random) -> list[str]:
    """Cut `text` into consecutive pieces of 0..6 characters (empty pieces happen in streaming too)."""
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(0, 6)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def test_sample_texts_split_multibyte_characters_across_tokens(tokenizer: Tokenizer) -> None:
    """Guard for the tests below: some sample token decodes alone to an incomplete character."""
    ids = [i for text in SAMPLE_TEXTS for i in tokenizer.encode(text, add_special_tokens=False)]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_streamed_text_concatenates_to_full_decode(tokenizer: Tokenizer, rng: random.Random) -> None:
    """Any split of encoded text, with special tokens sprinkled in, streams to exactly decode(all ids)."""
    special_ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    prompt = tokenizer.encode("<|im_start|>user\nSay something 😀<|im_end|>\n<|im_start|>assistant\n")
    for _ in range(200):
        text = rng.choice(SAMPLE_TEXTS) + " " + rng.choice(SAMPLE_TEXTS)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(special_ids))
        pieces = _stream(tokenizer, prompt, _random_split(ids, rng))
        assert "".join(pieces) == tokenizer.decode(ids) == text


def test_streamed_arbitrary_token_ids_concatenate_to_full_decode(
    tokenizer: Tokenizer, rng: random.Random
) -> None:
    """Even random ids (invalid UTF-8 included) stream to decode(all ids), U+FFFD in the same places."""
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 8))]
        pieces = _stream(tokenizer, prompt, _random_split(ids, rng))
        assert "".join(pieces) == tokenizer.decode(ids)


def test_no_partial_utf8_is_ever_emitted(tokenizer: Tokenizer, rng: random.Random) -> None:
    """Token by token, every emitted piece is whole characters: no U+FFFD and always a prefix of the text."""
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for chunks in ([[i] for i in ids], _random_split(ids, rng)):
            detok = IncrementalDetokenizer(tokenizer, [])
            emitted = ""
            for chunk in chunks:
                piece = detok.push(chunk)
                assert "\ufffd" not in piece
                emitted += piece
                assert text.startswith(emitted)
            assert emitted + detok.flush() == text


def test_detokenizer_holds_back_then_completes_a_split_emoji(tokenizer: Tokenizer) -> None:
    """An emoji spread over byte tokens yields nothing until its last byte, then the whole emoji."""
    ids = tokenizer.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦀"]
    assert detok.flush() == ""


def test_flush_returns_an_incomplete_tail_as_replacement_char(tokenizer: Tokenizer) -> None:
    """A request cut mid-character ends with what a full decode gives (U+FFFD), not silently dropped text."""
    ids = tokenizer.encode("ok 🦀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.push([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids)
    assert tokenizer.decode(ids).endswith("\ufffd")


def test_stop_string_truncates_and_never_leaks_across_chunk_boundaries(rng: random.Random) -> None:
    """For random chunkings, output equals the text cut before its first stop string, and no emitted
    piece contains the start of that stop string."""
    alphabet = "ab😀 \n"
    stop_sets = [["ab"], ["aab", "b😀"], ["\n\n"], ["abab", "😀😀a"], ["a"], ["zzz"]]
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = rng.choice(stop_sets)
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        expected = text[: min(hits)] if hits else text

        matcher = StopStringMatcher(stops)
        emitted, stopped = "", False
        for piece in _split_chars(text, rng):
            out, stopped = matcher.feed(piece)
            emitted += out
            # What has left the matcher is always a prefix of the answer: nothing of a stop string leaks.
            assert expected.startswith(emitted)
            if stopped:
                break
        if not stopped:
            emitted += matcher.flush()
        assert emitted == expected
        assert stopped == bool(hits)


def test_stop_matcher_holds_only_a_possible_stop_prefix() -> None:
    """Text that cannot start a stop string is emitted at once; a possible start waits for the next piece."""
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed(" and ST") == (" and ", False)
    assert matcher.feed("OP here") == ("", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_matcher_without_stop_strings_passes_text_through() -> None:
    """No stop strings means no buffering at all."""
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""


def test_detokenizer_and_stop_matcher_compose_to_truncated_full_decode(
    tokenizer: Tokenizer, rng: random.Random
) -> None:
    """The engine's pipeline (ids -> detokenizer -> stop matcher) matches decode-then-truncate."""
    for _ in range(100):
        text = rng.choice(SAMPLE_TEXTS) + rng.choice(SAMPLE_TEXTS)
        ids = tokenizer.encode(text, add_special_tokens=False)
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 3)]
        expected = text[: text.find(stop)]

        detok, matcher = IncrementalDetokenizer(tokenizer, []), StopStringMatcher([stop])
        emitted, stopped = "", False
        for chunk in _random_split(ids, rng):
            out, stopped = matcher.feed(detok.push(chunk))
            emitted += out
            if stopped:
                break
        if not stopped:
            out, stopped = matcher.feed(detok.flush())
            emitted += out + matcher.flush()
        assert stopped
        assert emitted == expected


def test_eos_ids_union_generation_and_tokenizer_config(tokenizer: Tokenizer) -> None:
    """generation_config's eos list and tokenizer_config's eos token both end generation; config.json is
    only a fallback."""
    assert tokenizer.eos_token_ids == [
        tokenizer.token_to_id("<|endoftext|>"),
        tokenizer.token_to_id("<|im_end|>"),
    ]
    assert tokenizer.bos_token_id == tokenizer.token_to_id("<|im_start|>")


def test_eos_and_bos_fall_back_to_config_json(tmp_path: Path, model_dir: Path) -> None:
    """Without generation_config and tokenizer_config entries, config.json's ids are used."""
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1, 2], "bos_token_id": 0}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == [1, 2]
    assert tok.bos_token_id == 0


def test_encode_decode_roundtrip_and_vocab(tokenizer: Tokenizer) -> None:
    """Byte-level BPE round-trips any text; special tokens are dropped from decode by default."""
    text = "Hello 😀 <|im_end|> done"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "Hello 😀  done"
    assert tokenizer.vocab_size == 400
    assert tokenizer.convert_ids_to_tokens([tokenizer.token_to_id("<|im_end|>")]) == ["<|im_end|>"]
    assert tokenizer.id_to_token(10**9) is None


def test_chat_template_renders_messages(tokenizer: Tokenizer) -> None:
    """ChatML renders each message and, when asked, the assistant header; trim_blocks drops tag newlines."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tokenizer.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3


def test_chat_template_raise_exception_is_a_chat_template_error(tokenizer: Tokenizer) -> None:
    """A template's raise_exception() surfaces as ChatTemplateError with its message."""
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(model_dir: Path) -> None:
    """A template cannot mutate the caller's messages or reach Python internals."""
    tok = Tokenizer.from_dir(model_dir)
    messages = [{"role": "user", "content": "hi"}]
    tok.chat_template = "{{ messages.append({'role': 'x'}) }}"
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]
    tok = Tokenizer.from_dir(model_dir)
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(messages)


def test_missing_chat_template_is_clear_error(tmp_path: Path, model_dir: Path) -> None:
    """A model without a chat template refuses chat messages with an explanation, not a jinja traceback."""
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_is_clear_error(tmp_path: Path) -> None:
    """Pointing at a directory without tokenizer.json names the file that is missing."""
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.skipif(
    not (SMOLLM_DIR / "tokenizer.json").is_file(),
    reason=f"converted SmolLM2 tokenizer not present at {SMOLLM_DIR} (produced by the model conversion step)",
)
def test_smollm2_streamed_text_concatenates_to_full_decode(rng: random.Random) -> None:
    """On the real SmolLM2 tokenizer, random splits of multilingual text stream to exactly decode(ids)."""
    tok = Tokenizer.from_dir(SMOLLM_DIR)
    assert tok.eos_token_ids
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False
    )
    for _ in range(100):
        text = " ".join(rng.sample(SAMPLE_TEXTS + CORPUS, 3))
        ids = tok.encode(text, add_special_tokens=False) + tok.eos_token_ids[:1]
        pieces = _stream(tok, prompt, _random_split(ids, rng))
        assert "".join(pieces) == tok.decode(ids) == text


def _commit_stream(
    tokenizer: Tokenizer, ids: list[int], chunks: list[list[int]], params: SamplingParams
) -> tuple[list[int], str, str | None]:
    """Commit `chunks` through an OutputProcessor until it finishes: (tokens kept, text, reason)."""
    seq = Sequence("r", 0, ids[:2], params, None)
    processor = OutputProcessor(seq, tokenizer, tokenizer.eos_token_ids, max_model_len=10_000)
    text, reason = "", None
    for chunk in chunks:
        _, piece, reason = processor.commit(chunk)
        text += piece
        if reason is not None:
            break
    return seq.output_token_ids, text, reason


def test_output_processor_gives_the_same_stream_whatever_the_commit_sizes(
    tokenizer: Tokenizer, rng: random.Random
) -> None:
    """A speculative step commits several tokens at once: the tokens kept, the text and the finish
    reason are those of committing one token at a time, with EOS, stop token ids, max_tokens and
    stop strings (including one split across commits) ending the request mid-chunk."""
    eos = tokenizer.eos_token_ids[0]
    for _ in range(150):
        text = " ".join(rng.sample(SAMPLE_TEXTS + CORPUS, 2))
        ids = [tokenizer.token_to_id("<|im_start|>")] + tokenizer.encode(text, add_special_tokens=False)
        generated = ids[2:] + [eos] * rng.randint(0, 1) + tokenizer.encode("tail", add_special_tokens=False)
        words = text.split()
        params = SamplingParams(
            max_tokens=rng.randint(1, len(generated) + 2),
            stop=[rng.choice(words)[-3:]] if rng.random() < 0.4 else [],
            stop_token_ids=[rng.choice(generated)] if rng.random() < 0.2 else [],
            ignore_eos=rng.random() < 0.3,
        )
        one_by_one = _commit_stream(tokenizer, ids, [[t] for t in generated], params)
        chunked = _commit_stream(tokenizer, ids, _random_split(generated, rng), params)
        assert chunked == one_by_one
        assert one_by_one[2] is not None or len(one_by_one[0]) == len(generated)


def _deltas(
    tokenizer: Tokenizer, ids: list[int], chunks: list[list[int]], params: SamplingParams, defer: bool
):
    """The engine's deltas of `chunks` (`OutputProcessor.commit_ids`, then `PendingDelta.make`), their
    text made now or left to the receiver (`defer`)."""
    seq = Sequence("r", 0, ids[:2], params, None)
    processor = OutputProcessor(seq, tokenizer, tokenizer.eos_token_ids, max_model_len=10_000)
    deltas = []
    for chunk in chunks:
        appended, reason = processor.commit_ids(chunk)
        deltas.append(PendingDelta(processor, tuple(appended), reason).make(defer_text=defer))
        if reason is not None:
            break
    return deltas


def test_text_made_by_the_receiver_equals_the_engines_whatever_the_merging(
    tokenizer: Tokenizer, rng: random.Random
) -> None:
    """The engine process leaves a request's text to the adapter (`RequestDelta.text_pending`,
    `DeltaText`): delta for delta, and over deltas merged as a slow reader merges them, the text is
    the engine's own, with EOS, stop token ids and max_tokens ending the request mid-chunk."""
    eos = tokenizer.eos_token_ids[0]
    for _ in range(150):
        text = " ".join(rng.sample(SAMPLE_TEXTS + CORPUS, 2))
        ids = [tokenizer.token_to_id("<|im_start|>")] + tokenizer.encode(text, add_special_tokens=False)
        generated = ids[2:] + [eos] * rng.randint(0, 1) + tokenizer.encode("tail", add_special_tokens=False)
        params = SamplingParams(
            max_tokens=rng.randint(1, len(generated) + 2),
            stop_token_ids=[rng.choice(generated)] if rng.random() < 0.2 else [],
            ignore_eos=rng.random() < 0.3,
            skip_special_tokens=rng.random() < 0.8,
        )
        chunks = _random_split(generated, rng)
        made = _deltas(tokenizer, ids, chunks, params, defer=False)
        left = _deltas(tokenizer, ids, chunks, params, defer=True)
        assert all(d.text_pending and d.new_text == "" for d in left)
        assert [d.new_token_ids for d in left] == [d.new_token_ids for d in made]
        # Merged in random runs (what crosses the pipe when the adapter reads slower than the engine).
        merged, start = [], 0
        while start < len(left):
            end = start + rng.randint(1, 3)
            merged.append(merge_deltas(left[start:end]))
            start = end
        receiver = DeltaText(IncrementalDetokenizer(tokenizer, ids[:2], params.skip_special_tokens))
        texts = [receiver.text_of(d.new_token_ids, d.finish_reason) for d in merged]
        assert "".join(texts) == "".join(d.new_text for d in made)
        assert merged[-1].finish_reason == made[-1].finish_reason


def test_a_made_delta_carries_each_value_in_its_own_field(tokenizer: Tokenizer) -> None:
    """`PendingDelta.make` passes RequestDelta's fields by position (for its speed): each lands where
    it belongs."""
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    seq = Sequence("the-request", 0, ids, SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1), None)
    seq.spec_stats.record_step(3, 2, 1)
    processor = OutputProcessor(seq, tokenizer, tokenizer.eos_token_ids, max_model_len=10_000)
    appended, reason = processor.commit_ids(ids[:2])
    processor.add_logprobs([{ids[0]: -0.5}, {ids[1]: -0.25}], [-0.5, -0.25])
    delta = PendingDelta(processor, tuple(appended), reason, error="an error").make(defer_text=True)
    assert delta.request_id == "the-request"
    assert delta.new_token_ids == ids[:2] and delta.new_text == ""
    assert delta.finished and delta.finish_reason == "length" == reason
    assert (delta.num_prompt_tokens, delta.num_output_tokens) == (len(ids), 2)
    assert delta.spec_stats is seq.spec_stats and delta.error == "an error"
    assert delta.logprobs is not None and len(delta.logprobs) == 2
    assert delta.cumulative_logprob == -0.75 and delta.text_pending
