"""Tensor parallelism: the process group and the worker processes that hold the other ranks."""
