"""Shared by the Harmony tests (tests/unit/test_harmony*.py): harmony's own encoding and our format."""

from __future__ import annotations

import itertools

import pytest

from router.harmony import HarmonyFormat
from router.tokenizer import load_encoding


@pytest.fixture(scope="module")
def enc():
    return load_encoding()


def make_format(enc) -> HarmonyFormat:
    counter = itertools.count()
    return HarmonyFormat(enc, call_id=lambda: f"call_{next(counter)}")


@pytest.fixture
def fmt(enc):
    return make_format(enc)


def encode(enc, text: str) -> list[int]:
    return enc.encode(text, allowed_special="all")
