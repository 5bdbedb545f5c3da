"""Where the Triton kernels of prefixserve/platforms/cuda are tested: compiled on the GPU where there is
one, on the CPU under Triton's interpreter (float32) elsewhere (tests/conftest.py chooses the mode)."""
from __future__ import annotations

import torch

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
