"""--mixed-attention: which rows of a mixed step FlashInfer may read apart (the one-token rows the scheduler
lists first, then chunks; kernels/flashinfer_host.mixed_split_point), and the flag's error on a backend that has
no such reads. The reads themselves are GPU-only (tests/kernels/test_attention_gpu.py)."""

import pytest

from common.errors import ConfigError
from engine.build import EngineConfig, load_model
from kernels.flashinfer_host import mixed_split_point


@pytest.mark.parametrize("q_lens,k", [
    ([1, 1, 1, 300, 40], 3),  # running decodes, then admitted chunks
    ([1, 280], 1),
    ([1, 1, 1], 0),  # a decode step: nothing to split
    ([300, 40], 0),  # chunks only
    ([1, 300, 1, 40], 0),  # interleaved: one launch
    ([300, 1], 0),
    ([], 0),
])
def test_mixed_split_point(q_lens, k):
    assert mixed_split_point(q_lens) == k


def test_mixed_attention_needs_flashinfer(ckpt_factory):
    cfg = EngineConfig(checkpoint=ckpt_factory("tiny-a"), mixed_attention="split-fa3")
    with pytest.raises(ConfigError, match="mixed-attention split-fa3 needs the flashinfer"):
        load_model(cfg)
