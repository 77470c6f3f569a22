"""Text handling: tokenizer loading, chat templates, incremental detokenization and stop strings."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "Tokenizer",
]

# How many prompt tokens seed the detokenizer's prefix window. A few are enough for decoders whose
# output for a token depends on its neighbours (e.g. SentencePiece's leading-space rule).
_INITIAL_PREFIX_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """The chat template is missing, or it rejected the messages (a client error, not a server one)."""


def _read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """The string of a special-token entry (HF stores a plain string or an AddedToken dict)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    """Normalize an `eos_token_id`-style field (int, list of ints or null) to a list."""
    if isinstance(value, bool):  # bool is an int subclass; never a token id
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_chat_template(value: Any) -> str | None:
    """The default chat template; HF allows one string or a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def _raise_exception(message: str) -> None:
    """Template helper HF chat templates call to reject input (e.g. an unsupported role order)."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """Template `tojson` filter that keeps non-ASCII text as is (jinja's built-in one HTML-escapes)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """Template helper some chat templates use to insert today's date."""
    return datetime.now().strftime(fmt)


def _make_template_env() -> ImmutableSandboxedEnvironment:
    """A sandboxed jinja environment configured the way HF renders chat templates."""
    # Templates come with downloaded checkpoints, so they are untrusted code: the immutable sandbox
    # blocks attribute access to internals and mutation of the messages we pass in.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        extensions=[jinja2.ext.loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Tokenizer:
    """A Hugging Face tokenizer (tokenizer.json) plus its special-token and chat-template metadata."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_token_strings: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        """Wrap an already loaded `tokenizers.Tokenizer`; most callers want `from_dir`."""
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._special_token_strings = dict(special_token_strings or {})
        self._eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self._bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self._compiled_template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json and the config files next to it from a Hugging Face model directory."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        tok = _HFTokenizer.from_file(str(tokenizer_file))
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")

        chat_template = _pick_chat_template(tok_cfg.get("chat_template"))
        if chat_template is None:
            # Newer checkpoints keep the template in its own file instead of tokenizer_config.json.
            jinja_file = root / "chat_template.jinja"
            if jinja_file.is_file():
                chat_template = jinja_file.read_text(encoding="utf-8")
            else:
                chat_template = _pick_chat_template(
                    _read_json(root / "chat_template.json").get("chat_template")
                )

        special_strings: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(tok_cfg.get(key))
            if content is not None:
                special_strings[key] = content
        bos_token = special_strings.get("bos_token")
        eos_token = special_strings.get("eos_token")

        # EOS: a generation ends on any of the ids generation_config lists (chat models often list
        # several, e.g. <|im_end|> and <|endoftext|>) or on the tokenizer's own eos token.
        eos_ids = _as_id_list(gen_cfg.get("eos_token_id"))
        if eos_token is not None and (eos_id := tok.token_to_id(eos_token)) is not None:
            eos_ids.append(eos_id)
        if not eos_ids:
            eos_ids = _as_id_list(model_cfg.get("eos_token_id"))

        bos_id: int | None = tok.token_to_id(bos_token) if bos_token is not None else None
        if bos_id is None:
            for cfg in (gen_cfg, model_cfg):
                ids = _as_id_list(cfg.get("bos_token_id"))
                if ids:
                    bos_id = ids[0]
                    break
        if bos_token is None and bos_id is not None:
            bos_token = tok.id_to_token(bos_id)

        add_bos = tok_cfg.get("add_bos_token")
        return cls(
            tok,
            chat_template=chat_template,
            bos_token=bos_token,
            eos_token=eos_token,
            special_token_strings=special_strings,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        )

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a generation (generation_config's list plus the tokenizer's eos token)."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, if the model has one."""
        return self._bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, whatever tokenizer.json's post-processor adds."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer_config's add_bos_token is honoured by transformers by rewriting the post-processor;
        # when tokenizer.json's post-processor does not add BOS itself, add it here to match.
        if (
            add_special_tokens
            and self.add_bos_token
            and self._bos_token_id is not None
            and (not ids or ids[0] != self._bos_token_id)
        ):
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """Token strings (vocabulary form, e.g. byte-level 'Ġ' for a space); None for unknown ids."""
        return [self._tok.id_to_token(i) for i in ids]

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id, or None if it is out of range."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None if it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        """The messages rendered by the chat template, the assistant's turn opened, and its token ids.

        Encoded without adding special tokens, as transformers' apply_chat_template(tokenize=True) does:
        the template writes them itself. ChatTemplateError when the model has no template or it
        refuses the messages.
        """
        rendered = self.apply_chat_template(messages, add_generation_prompt=True)
        return rendered, self.encode(rendered, add_special_tokens=False)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of `chat_prompt`."""
        return self.chat_prompt(messages)[1]

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render chat messages to a prompt string; encode it with add_special_tokens=False (it has them)."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template (no 'chat_template' in tokenizer_config.json and no "
                "chat_template.jinja); send a plain-text prompt instead of chat messages"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of objects with 'role' and 'content'")
        if self._compiled_template is None:
            try:
                self._compiled_template = _make_template_env().from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e
        context: dict[str, Any] = dict(self._special_token_strings)
        context.update(kwargs)
        context["messages"] = messages
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled_template.render(**context)
        except jinja2.exceptions.TemplateError as e:
            # raise_exception() in the template lands here: the template refused these messages.
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from e


class IncrementalDetokenizer:
    """Turns one request's stream of generated token ids into text, never splitting a UTF-8 character."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        """Start after the prompt; its last few tokens seed the decode window."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_PREFIX_TOKENS:])
        if tokenizer.decode(self._ids, skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character (only possible for prompts given as ids): generated
            # bytes would merge into it and the diff against the window would be off, so start fresh
            # and report exactly decode(generated ids).
            self._ids = []
        # ids[prefix_offset:read_offset] were already turned into text (they give decoders context);
        # ids[read_offset:] are held back because their text ended in an incomplete character.
        self._read_offset = len(self._ids)
        self._prefix_offset = 0

    def _diff(self) -> tuple[str, str]:
        """(text of the whole window, the part of it past the already emitted prefix)."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special)
        return full_text, full_text[len(prefix_text) :]

    def _advance(self) -> None:
        """Mark everything pushed so far as emitted; keep only the last chunk as the next prefix window."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop ids left of the window so memory stays bounded on long generations.
        if self._prefix_offset:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add newly committed ids; return only the text they complete (possibly empty)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        full_text, new_text = self._diff()
        # A trailing U+FFFD means the last token(s) end inside a multi-byte character: hold back until it
        # completes (a genuine or invalid-byte U+FFFD just waits for the next character or flush). Empty
        # new text (e.g. only skipped special tokens) also waits, so the prefix window never shrinks to
        # tokens with no text, which would change how the next token's leading space decodes.
        if not new_text or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._advance()
        return new_text

    def flush(self) -> str:
        """At the end of the request, return whatever is still held back (incomplete bytes as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        _, new_text = self._diff()
        self._advance()
        return new_text


class DeltaText:
    """One request's text, made from its deltas' committed token ids in order, for a request whose ids
    decide its finish (no stop strings): the engine's `OutputProcessor.text_of`, and the receiver of
    its deltas where the engine leaves the text to it (`RequestDelta.text_pending`)."""

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        """Make the text with this request's detokenizer (started after its prompt)."""
        self._detokenizer = detokenizer

    @classmethod
    def after_prompt(
        cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> DeltaText:
        """The text of a request with this prompt, made by a detokenizer of its own."""
        return cls(IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens))

    def text_of(self, token_ids: Sequence[int], finish_reason: str | None) -> str:
        """The new text of a delta's tokens: a stop id that ends the request stays among the ids, not
        in the text (vLLM); a request that ended by its ids ("stop", "length") flushes what was held
        back; an aborted or failed one drops it, as the engine does."""
        text = self._detokenizer.push(token_ids[:-1] if finish_reason == "stop" else token_ids)
        if finish_reason in ("stop", "length"):
            text += self._detokenizer.flush()
        return text


class StopStringMatcher:
    """Cuts one request's streamed text at the first stop string, never emitting any part of it."""

    def __init__(self, stop: Sequence[str]) -> None:
        """Match any of `stop` (empty strings are ignored)."""
        self._stops = [s for s in dict.fromkeys(stop) if s]
        # A held-back tail is always shorter than the longest stop string.
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen; later text is dropped."""
        return self._stopped

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def feed(self, text: str) -> tuple[str, bool]:
        """Add streamed text; return (text safe to emit now, whether a stop string was hit)."""
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        # Earliest start wins: the non-streamed answer is the full text cut before its first stop string.
        cut = min((i for s in self._stops if (i := buffer.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._stopped = True
            self._held = ""
            return buffer[:cut], True
        hold = self._held_suffix_len(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At the end of a request that did not stop, return the held-back tail."""
        held, self._held = self._held, ""
        return "" if self._stopped else held
