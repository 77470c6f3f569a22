"""Acceptance of a step's verify windows, greedy and sampled, each in one call where the logits are.

Greedy (`greedy_accept_all`, the accept kernel on a GPU): draft i is kept while it equals the
target's argmax at its row; the token after the kept drafts is the argmax there (the bonus).

Sampled (`rejection_accept_all`, the rejection kernel on a GPU): draft i is kept while
u_i * p_d(d_i) < p_t(d_i); the first rejected position draws from normalize(max(0, p_t - p_d)); if
every draft passes, the bonus is drawn from p_t at the last row. The random numbers come from each
request's own generator in fixed amounts a step (`num_uniforms` uniforms, then one exponential per
vocabulary entry), so a seeded stream replays whatever the batch and whatever was accepted. One sum
over every distribution of the step rides in the same copy to the host: when it is not finite, the
requests whose distributions hold a NaN or inf get NON_FINITE_TOKEN.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from dspark.kernels import ops
from dspark.runner.host_to_device import to_device, to_host_queued
from dspark.sampling.sampler import (
    NON_FINITE_TOKEN,
    draw_exponentials_into,
    draw_uniforms_into,
    filtered_probs_of_requests,
)
from dspark.sampling_params import SamplingParams


def rejection_accept_all(
    drafts: Sequence[list[int]],
    draft_probs: Sequence[torch.Tensor | None],
    target_logits: Sequence[torch.Tensor],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    num_uniforms: int,
) -> tuple[list[int], list[int]]:
    """Per request: (drafts kept, the token after them); the token is NON_FINITE_TOKEN when the
    request's target or draft distributions are not finite.

    drafts[i]: the l_i drafts request i verifies; draft_probs[i]: [>= l_i, vocab] the distributions
    they were drawn from (None when l_i = 0); target_logits[i]: [l_i + 1, vocab] its window's logit
    rows, all on one device; num_uniforms >= every l_i: uniforms each request draws.
    """
    count = len(drafts)
    device = target_logits[0].device
    lens = [len(d) for d in drafts]
    width = max(max(lens), 1)
    vocab = target_logits[0].shape[-1]
    target = filtered_probs_of_requests(target_logits, params)
    proposed = torch.zeros(count, width, vocab, dtype=torch.float32, device=device)
    for i, (probs, n) in enumerate(zip(draft_probs, lens, strict=True)):
        if n:
            assert probs is not None
            proposed[i, :n] = probs[:n].to(device=device, dtype=torch.float32)
    tokens = torch.tensor([row + [0] * (width - len(row)) for row in drafts], dtype=torch.long)
    # Each request's draws land in its own rows: two launches a request, nothing copied.
    uniforms = torch.zeros(count, max(width, num_uniforms), device=device)
    exponentials = torch.empty(count, vocab, device=device)
    for i, generator in enumerate(generators):
        draw_uniforms_into(uniforms[i, :num_uniforms], generator)
        draw_exponentials_into(exponentials[i], generator)
    uniforms = uniforms[:, :width].contiguous()
    window_lens = torch.tensor(lens, dtype=torch.long)
    cu = torch.zeros(count + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(window_lens + 1, 0)
    accepted, next_tokens = ops.rejection_accept(
        to_device(tokens, device),
        proposed,
        target,
        to_device(cu, device),
        to_device(window_lens, device),
        uniforms,
        exponentials,
    )
    # NaN or inf anywhere makes the step's total so: one reduction, brought back with the tokens.
    finite = torch.isfinite(target.sum() + proposed.sum()).long()
    both = torch.cat([accepted, next_tokens, finite[None]]).tolist()
    accepted_list, tokens = both[:count], both[count : 2 * count]
    if not both[-1]:
        broken = _non_finite_requests(target, proposed, lens)
        tokens = [NON_FINITE_TOKEN if bad else t for t, bad in zip(tokens, broken, strict=True)]
    return accepted_list, tokens


def _non_finite_requests(target: torch.Tensor, proposed: torch.Tensor, lens: list[int]) -> list[bool]:
    """Per request: whether its target rows (target: [sum of lens + 1, vocab], packed in order) or its
    draft distributions (proposed: [count, width, vocab]) hold a NaN or inf."""
    row_sums = target.sum(-1).split([n + 1 for n in lens])
    target_ok = torch.stack([torch.isfinite(rows.sum()) for rows in row_sums])
    draft_ok = torch.isfinite(proposed.sum((1, 2)))
    return (~(target_ok & draft_ok)).tolist()


@dataclass(frozen=True)
class GreedyAcceptance:
    """Greedy acceptance on the host: per verify window the drafts accepted (`accepted`), the token
    after them (`bonus`) and the drafts it verified (`drafts`, brought back in the same copy); and the
    argmax of every logit row after the windows (`rest`: the prefill chunks' last rows)."""

    accepted: list[int]
    bonus: list[int]
    drafts: list[list[int]]
    rest: list[int]


def greedy_accept_all(
    verify_lens: Sequence[int], commit_caps: Sequence[int], drafts: torch.Tensor | None, argmax: torch.Tensor
) -> GreedyAcceptance:
    """Greedy acceptance of every verify window (`queue_greedy_accept`), read on the host at once."""
    return queue_greedy_accept(verify_lens, commit_caps, drafts, argmax).result()


@dataclass(frozen=True)
class QueuedGreedyAcceptance:
    """Greedy acceptance queued on the device, its copy to the host under way: per verify window the
    drafts accepted and the token after them on the device (`accepted`, `bonus`), the argmax of the
    rows after the windows (`rest`), and `result()`, which waits for the copy. `accepted` is None when
    no window verified a draft (a plain step): none was accepted, and the copy holds the argmax alone."""

    accepted: torch.Tensor | None
    bonus: torch.Tensor
    rest: torch.Tensor  # the argmax of the logit rows after the windows (prefill chunks' last rows)
    _host: torch.Tensor  # accepted, bonus, the verified drafts, the rest: on the host once `_ready`
    _ready: torch.cuda.Event | None
    verify_lens: tuple[int, ...]
    width: int

    def per_output(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Per output of the step, on the device: its verify windows, then the rows after them (a
        prefill chunk's last row, nothing accepted): (drafts accepted, the token committed last), what
        a step launched before this one is read takes (`dspark.runner.deferred_inputs`). Drafts
        accepted is None when no window verified any (a plain step): none can have been accepted."""
        accepted = self.accepted
        if not self.rest.numel():  # a decode-only step (most are): no copies to make
            return accepted, self.bonus
        if accepted is not None:
            accepted = torch.cat([accepted, torch.zeros_like(self.rest)])
        return accepted, torch.cat([self.bonus, self.rest])

    def result(self) -> GreedyAcceptance:
        """The acceptance on the host (waits for the device to get there)."""
        if self._ready is not None:
            self._ready.synchronize()
        host = self._host.tolist()
        num, width = len(self.verify_lens), self.width
        if self.accepted is None:  # a plain step: the argmax of every row, nothing judged
            return GreedyAcceptance([0] * num, host[:num], [[] for _ in range(num)], host[num:])
        flat = host[2 * num : 2 * num + num * width]
        verified = [flat[r * width : r * width + n] if width else [] for r, n in enumerate(self.verify_lens)]
        return GreedyAcceptance(host[:num], host[num : 2 * num], verified, host[2 * num + num * width :])


def window_bounds(
    verify_lens: Sequence[int], commit_caps: Sequence[int], device: torch.device
) -> torch.Tensor:
    """The accept kernel's window metadata on `device`, in one tensor: the windows' boundaries in the
    packed rows (cu, [windows + 1]), their verify lengths and commit caps ([windows] each). Made in
    Python and copied at once: each small host torch op costs microseconds of the step's host time,
    which bounds a step at batch 64; a burst's steps share one plan, and so one of these."""
    cu = [0, *itertools.accumulate(n + 1 for n in verify_lens)]
    return to_device(torch.tensor([*cu, *verify_lens, *commit_caps], dtype=torch.long), device)


def queue_greedy_accept(
    verify_lens: Sequence[int],
    commit_caps: Sequence[int],
    drafts: torch.Tensor | None,
    argmax: torch.Tensor,
    bounds: torch.Tensor | None = None,
    copy: bool = True,
) -> QueuedGreedyAcceptance:
    """Greedy acceptance of every verify window where the argmax is (`ops.greedy_accept`: the accept
    kernel on a GPU), and the copy to the host of what the step commits, queued: nothing waits here.

    verify_lens, commit_caps: per window, the drafts verified and the most that may be kept; drafts:
    [windows, >= max verify_lens] the drafts (any device; None: nothing was drafted); argmax: [rows]
    the target's argmax of every logit row of the step. Verify windows come first in the packed step
    and every one of their rows has logits, so window r's argmax rows are argmax[cu[r] : cu[r + 1]]
    with no gather; the rows after them are the prefill chunks' last rows. Sampling requests' windows
    are judged too and their results ignored. bounds: `window_bounds` of these windows, made already
    (None: made here); copy: False leaves the copy to the caller (`copy_together`), its host tensor
    still on the device meanwhile."""
    num = len(verify_lens)
    device = argmax.device
    if not any(verify_lens):
        # Plain windows (or none), one row each: nothing to judge, each commits its row's argmax. No
        # kernel, no copy of window bounds, no accepted counts: the copy back is the argmax alone (each
        # small device op is microseconds of the host on every plain step).
        return _queue_copy(None, argmax[:num], argmax[num:], argmax, tuple(verify_lens), 0, copy)
    meta = window_bounds(verify_lens, commit_caps, device) if bounds is None else bounds
    window_rows = sum(verify_lens) + num
    cu_d, lens_d, caps_d = meta[: num + 1], meta[num + 1 : 2 * num + 1], meta[2 * num + 1 :]
    if drafts is None:
        drafts = torch.zeros(num, 1, dtype=torch.long, device=device)
        width = 0
    else:
        drafts = to_device(drafts, device)
        # Whole rows when they are contiguous (a view: no copy before the concatenation); the host
        # reads each window's first verify_lens[r] of them.
        width = drafts.shape[1] if drafts.is_contiguous() else max(verify_lens)
    accepted, bonus = ops.greedy_accept(drafts, argmax[:window_rows], cu_d, lens_d, caps_d)
    # The verified drafts come back in the same copy (the host emits the accepted ones).
    rest = argmax[window_rows:]
    both = torch.cat([accepted, bonus, drafts[:, :width].flatten(), rest])
    return _queue_copy(accepted, bonus, rest, both, tuple(verify_lens), width, copy)


def copy_together(queued: Sequence[QueuedGreedyAcceptance]) -> list[QueuedGreedyAcceptance]:
    """The acceptances of several steps (queued with copy=False, in launch order) with one copy to the
    host for all of them behind one event, each reading its own slice: a burst's steps queue one copy,
    not one each (a pinned buffer, a copy and an event are tens of microseconds of host time a step)."""
    if not queued:
        return []
    host, ready = _to_host(torch.cat([q._host for q in queued]))
    out, start = [], 0
    for q in queued:
        size = q._host.shape[0]
        out.append(replace(q, _host=host[start : start + size], _ready=ready))
        start += size
    return out


def _queue_copy(
    accepted: torch.Tensor | None,
    bonus: torch.Tensor,
    rest: torch.Tensor,
    both: torch.Tensor,
    verify_lens: tuple[int, ...],
    width: int,
    copy: bool = True,
) -> QueuedGreedyAcceptance:
    """Start the copy of `both` to the host: into pinned memory behind an event on a GPU (the host
    reads it once the event has passed), as it is elsewhere. copy: False leaves `both` where it is
    (`copy_together` copies it)."""
    host, ready = _to_host(both) if copy else (both, None)
    return QueuedGreedyAcceptance(accepted, bonus, rest, host, ready, verify_lens, width)


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`values` on the host, queued (`to_host_queued`), and the event after which the host may read
    them; off CUDA `values` themselves and no event."""
    if values.device.type != "cuda":
        return values, None
    host = to_host_queued(values)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(values.device))  # the copy's stream, whatever device is current
    return host, ready
