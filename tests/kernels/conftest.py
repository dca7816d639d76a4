"""Kernel tests run the real kernels on a GPU, and Triton's CPU interpreter everywhere else.

TRITON_INTERPRET is read when Triton is first imported, so it is set here, before any test module
imports an op (importing torch does not import Triton). A value set by the caller wins.
"""
import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def poison_empty(monkeypatch):
    """Fill every float torch.empty / empty_like made during the test with NaN, so an output or
    scratch element the kernels forget to write shows up as NaN instead of a lucky zero."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(real_empty_like(*a, **k)))
