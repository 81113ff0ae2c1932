"""Shared fixtures: tiny checkpoints written once per session in the exact HF layout, and the HF
transformers reference model loaded from the same files."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU every Triton kernel runs in the interpreter. @triton.jit reads TRITON_INTERPRET when a kernel
# is decorated, so it is set before any test module imports kernels/ (through engine/ too): a test that set
# it later got compiled-kernel objects it could not call ("outside of the scope of a kernel") in some -k runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", message=".*MXFP4.*")
# `make test` runs the suite on pytest-xdist workers (gw0, gw1, ...): each takes its own slice of launcher/ports.py's
# range, inherited by the services it starts, so two workers never race for one port between its check and its bind.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "TANDEM_PORT_RANGE" not in os.environ:
    from launcher.ports import DEFAULT_RANGE

    _n, _i = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), int(_worker[2:])
    _low, _span = DEFAULT_RANGE[0], (DEFAULT_RANGE[1] - DEFAULT_RANGE[0]) // max(_n, 1)
    if _span >= 2000:  # room for free_base_port's blocks of ~1,200 ports; more workers share the whole range
        os.environ["TANDEM_PORT_RANGE"] = f"{_low + _i * _span}-{_low + (_i + 1) * _span - 1}"


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    from model.checkpoint_io import write_random_checkpoint
    from model.config import preset

    made: dict[tuple[str, int], str] = {}

    def make(name: str, seed: int = 0) -> str:
        key = (name, seed)
        if key not in made:
            out = tmp_path_factory.mktemp(f"ckpt-{name}-{seed}")
            made[key] = str(write_random_checkpoint(preset(name), out, seed=seed))
        return made[key]

    return make


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test: the Triton interpreter's numpy (OpenBLAS) threads spin against
    torch's on 2 cores (~2x slower)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def hf_factory():
    """HF GptOssForCausalLM (eager attention, fp32, MXFP4 dequantised) from a checkpoint dir."""
    import torch
    from transformers import GptOssForCausalLM, Mxfp4Config
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cache = {}

    def load(path: str):
        if path not in cache:
            cache[path] = GptOssForCausalLM.from_pretrained(
                path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True),
                attn_implementation="eager").eval()
        return cache[path]

    return load
