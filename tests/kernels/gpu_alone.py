"""The marks of a GPU test file that must run in its own pytest process: CPU kernel tests set
TRITON_INTERPRET=1 at import (tests/conftest.py), which would send these files' Triton launches
to the interpreter."""

from __future__ import annotations

import os

import pytest
import torch

GPU_ALONE = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET is set (CPU tests imported first): run this file alone"),
]
