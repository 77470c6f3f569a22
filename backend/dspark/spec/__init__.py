"""Speculative decoding: the DSpark drafter, the verify planner, acceptance."""
