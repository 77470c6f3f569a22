"""The draft vocabulary: the tokens a drafter may propose, a reduced vocabulary in the manner of FR-Spec.

A block's drafts are read off vocabulary projections of the drafter's states through the target's LM
head, one per drafted position on the CPU, and that head is the drafter's largest read (49152 x 576 for
SmolLM2: more than the drafter's own layer; 151936 x 4096 for Qwen3-8B). Drafting from the K most
frequent tokens only reads K rows of it. Lossless whatever K: the target verifies every draft, and a
sampled draft is accepted against the draft distribution it was drawn from (zero outside the K
tokens); a smaller K only drafts a rare token less often.

A drafter directory may hold `draft_vocab.safetensors`: every token id of the vocabulary ordered by
descending frequency in the drafter's training prompts (ties, and tokens never seen, by id: a BPE
vocabulary's ids follow its merge order, itself a frequency order), and in its metadata the size the
drafter drafts from by default. `EngineConfig.draft_vocab_size` takes the first K of the order: 0, the
drafter's default (every token without the file), -1 every token.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def frequency_order(
    token_lists: Iterable[Iterable[int]], vocab_size: int, always: Iterable[int] = ()
) -> torch.Tensor:
    """Every id below vocab_size, most frequent first over token_lists (ties and unseen ids by id);
    `always` (special tokens: end of turn, end of text) first of all, so any K keeps them."""
    counts = collections.Counter(i for ids in token_lists for i in ids if 0 <= i < vocab_size)
    first = list(dict.fromkeys(i for i in always if 0 <= i < vocab_size))
    chosen = set(first)
    rest = sorted((i for i in range(vocab_size) if i not in chosen), key=lambda i: (-counts[i], i))
    return torch.tensor(first + rest, dtype=torch.int64)


def save_draft_vocab(order: torch.Tensor, draft_dir: str | Path, default_size: int = 0) -> Path:
    """Write the frequency order (`frequency_order`) into a drafter directory, with the size the drafter
    drafts from by default (0: every token)."""
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    metadata = {"format": "pt", "default_size": str(default_size)}
    save_file({"token_ids": order.to(torch.int64).contiguous()}, str(path), metadata=metadata)
    return path


def read_draft_vocab_order(draft_dir: str | Path, vocab_size: int) -> tuple[torch.Tensor, int]:
    """A drafter directory's whole token order (int64, on the CPU) and the size it drafts from by default
    (0: every token); checked to order the target's `vocab_size` ids."""
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    with safe_open(str(path), framework="pt") as f:
        order = f.get_tensor("token_ids").to(torch.int64)
        default = int((f.metadata() or {}).get("default_size", "0"))
    if order.numel() != vocab_size or not torch.equal(order.sort().values, torch.arange(vocab_size)):
        raise ValueError(f"{path}: not an ordering of the target's {vocab_size} token ids")
    return order, default


def load_draft_vocab(draft_dir: str | Path, size: int, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary (sorted ids, int64, on the CPU) of `size` tokens from a drafter directory
    (0: the size its file names, -1: every token); None when that is every token."""
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    if size < 0 or (size == 0 and not path.is_file()):
        return None
    if not path.is_file():
        raise ValueError(
            f"draft_vocab_size: {size} asks for a reduced draft vocabulary, but the drafter has no "
            f"{DRAFT_VOCAB_FILE} (`dspark draft-vocab` writes one); -1 drafts from every token"
        )
    order, default = read_draft_vocab_order(draft_dir, vocab_size)
    return leading_tokens(order, size or default)


def leading_tokens(order: torch.Tensor, size: int) -> torch.Tensor | None:
    """The sorted ids of an order's first `size` tokens; None when that is every token (or none)."""
    if size <= 0 or size >= order.numel():
        return None
    return order[:size].sort().values
