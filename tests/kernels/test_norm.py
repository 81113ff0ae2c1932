import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.norm import add_rms_norm, rms_norm  # noqa: E402


@pytest.mark.parametrize("t,h", [(1, 64), (5, 96), (3, 2880), (0, 64)])
def test_rms_norm_matches_reference(t, h):
    g = torch.Generator().manual_seed(t * 1000 + h)
    x = torch.randn(t, h, generator=g) * 3
    w = 1 + 0.1 * torch.randn(h, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t,h", [(4, 64), (2, 2880)])
def test_add_rms_norm_matches_add_then_norm(t, h):
    g = torch.Generator().manual_seed(h)
    x, d = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
    w = 1 + 0.1 * torch.randn(h, generator=g)
    xo, y = add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(xo, x + d)
    torch.testing.assert_close(y, ref.rms_norm(x + d, w, 1e-5), rtol=1e-6, atol=1e-6)
    # strided rows (a view into a wider buffer) work too
    wide = torch.randn(t, h + 32, generator=g)
    torch.testing.assert_close(rms_norm(wide[:, :h], w, 1e-5), ref.rms_norm(wide[:, :h], w, 1e-5), rtol=1e-6, atol=1e-6)
