"""pytest plugin: each test's peak GPU memory (allocated, reserved) appended to $GPUMEM_OUT."""

import os

import pytest
import torch


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    yield
    if torch.cuda.is_available():
        gib = 2**30
        allocated, reserved = torch.cuda.max_memory_allocated() / gib, torch.cuda.max_memory_reserved() / gib
        line = f"{allocated:7.2f} {reserved:7.2f} {item.nodeid}\n"
        with open(os.environ["GPUMEM_OUT"], "a") as out:
            out.write(line)
