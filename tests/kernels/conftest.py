"""Kernel tests: where no GPU is present, Triton kernels run on CPU tensors in Triton's interpreter.

TRITON_INTERPRET must be set before triton itself is imported (its standard library is jitted at import):
tests/conftest.py sets it first thing; it is set here too for runs of this folder's conftest alone.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def triton_device() -> str:
    """The device the Triton path runs on here: "cuda", or "cpu" under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (it is a Linux-only dependency)")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: Triton kernels cannot run here")
    return "cpu"
