"""Shared fixtures: the tiny pair (fast, fp32, CPU) and the real embedded pair (slow: marked `real`)."""

import pytest

from spec.models import load_pair


@pytest.fixture(scope="session")
def tiny():
    return load_pair("tiny", device="cpu")


@pytest.fixture(scope="session")
def real():
    """The embedded Qwen2.5-Coder 1.5B/0.5B pair, bf16 on CPU, loaded once per test session."""
    return load_pair("qwen-coder", device="cpu")
