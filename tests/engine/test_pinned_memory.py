"""engine/pinned_memory.py on the CPU machine: where page-locking is impossible (no CUDA driver, a failing
registration) a buffer still comes back, exactly sized and pageable, with one warning; the pinned path itself
is tested on the GPU machine (tests/gpu/test_pinned_memory_gpu.py)."""
import logging

import torch

from sd_accel.engine import pinned_memory


def test_pageable_when_not_pinning():
    buf = pinned_memory.empty_host(3 * (1 << 20) + 5, pin=False)
    assert buf.numel() == 3 * (1 << 20) + 5 and buf.dtype == torch.uint8 and not buf.is_pinned()


def test_a_failing_registration_falls_back_with_one_warning(monkeypatch, caplog):
    class NoRegister:
        def cudaHostRegister(self, ptr, n, flags):
            return 712                              # cudaErrorHostMemoryAlreadyRegistered, say

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: NoRegister())
    monkeypatch.setattr(pinned_memory, "_warned", [])
    before = pinned_memory.registered_bytes()
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        a = pinned_memory.empty_pinned(2 << 20)
        b = pinned_memory.empty_pinned(2 << 20)
    assert a.numel() == b.numel() == 2 << 20
    assert pinned_memory.registered_bytes() == before
    warnings = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warnings) == 1 and "712" in warnings[0].getMessage()
