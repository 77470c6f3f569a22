"""Log probabilities of committed tokens, as vLLM reports them (their form on the Triton interface:
`dspark.outputs.logprobs_json`).

The values are vLLM's default (`logprobs_mode="raw_logprobs"`): log_softmax of the target's own logits
at the committed token's position, before penalties, temperature and top-k / top-p, so they do not
depend on the request's sampling settings, and speculation does not change them (a verify window's
row i is the target's distribution after the drafts before it, which are then committed history).
Each committed token gets {token id: Logprob} holding the chosen token (its rank: how many tokens are
at least as likely) and the top-N tokens (ranks 1..N); a chosen token among the top-N keeps its top-N
rank, as in vLLM's `_make_logprob_dict`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.outputs import Logprob, TokenLogprobs
from dspark.tokenizer import Tokenizer

_SENTENCEPIECE_SPACE = "\u2581"


def gather_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """Per row: the token's log probability and rank, and the top `num_top` ids and log probabilities.

    logits: [n, vocab] raw target logits; tokens: [n] int64 on the same device. One copy to the host
    (ids and ranks ride in fp32, exact below 2**24)."""
    num_top = min(num_top, logits.shape[-1])  # a vocabulary smaller than the N asked for: all of it
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])
    ranks = (logprobs >= chosen).sum(-1, keepdim=True)
    parts = [chosen, ranks.float()]
    if num_top:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        parts += [top_ids.float(), top_logprobs]
    host = torch.cat(parts, dim=1).cpu()
    chosen_list = host[:, 0].tolist()
    rank_list = [int(r) for r in host[:, 1].tolist()]
    top_id_list = [[int(i) for i in row] for row in host[:, 2 : 2 + num_top].tolist()]
    top_lp_list = host[:, 2 + num_top :].tolist()
    return chosen_list, rank_list, top_id_list, top_lp_list


class LogprobsFormatter:
    """Builds each committed token's {token id: Logprob}, decoding token texts once per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def decoded(self, token_id: int) -> str:
        """The text of one token alone (vLLM's `convert_ids_list_to_tokens`: special tokens kept, a
        SentencePiece word's leading space restored)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self.tokenizer.id_to_token(token_id) or ""
            markers = len(piece) - len(piece.lstrip(_SENTENCEPIECE_SPACE))
            missing = markers - (len(text) - len(text.lstrip(" ")))
            if missing > 0:
                text = " " * missing + text
            self._texts[token_id] = text
        return text

    def entry(
        self, token: int, logprob: float, rank: int, top_ids: Sequence[int], top_logprobs: Sequence[float]
    ) -> TokenLogprobs:
        """One position's dict: the chosen token first, then the top tokens with ranks 1..N."""
        out = {token: Logprob(logprob, rank, self.decoded(token))}
        for k, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs, strict=True)):
            out[top_id] = Logprob(top_logprob, k + 1, self.decoded(top_id))
        return out
