"""What every kernel test module shares: the device, its kernels (in Triton's interpreter on a CPU) and
the mark for GPU-only cases. Their `gen` fixture is in conftest.py."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.runtime import load_kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = load_kernels(interpret=DEVICE.type == "cpu")
gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="realistic shapes: GPU only")
