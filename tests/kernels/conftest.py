"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from tests.support import fake_flashinfer as fake


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """kernels.flashinfer_backend on a torch stand-in for FlashInfer (tests/support/fake_flashinfer.py)."""
    return fake.install(monkeypatch)
