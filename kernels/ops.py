"""The ops the engine calls. Each name is the one seam where a Triton kernel takes over from its
torch reference; callers never choose. Until a kernel exists for an op, the reference serves all devices.
"""

from __future__ import annotations

from dspark.kernels import reference

rms_norm = reference.rms_norm
rotary = reference.rotary
store_kv = reference.store_kv
paged_attention = reference.paged_attention
greedy_accept = reference.greedy_accept
exponential_race_sample = reference.exponential_race_sample

__all__ = [
    "exponential_race_sample",
    "greedy_accept",
    "paged_attention",
    "rms_norm",
    "rotary",
    "store_kv",
]
