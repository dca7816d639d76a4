"""engine/memory/pinned_memory.py on the CPU machine: how buffers are packed into slabs (the same packing runs with
pageable slabs where pinning is unavailable, as here, after one warning); that the slabs are pinned and copies
from them are captured in CUDA graphs is tested on the GPU machine (tests/gpu/test_pinned_memory_gpu.py)."""
import logging

import pytest
import torch

from sd_accel.engine.memory import pinned_memory
from sd_accel.engine.memory.pinned_memory import SLAB_MIN, host_buffers

MIB = 1 << 20


def _slabs(bufs):
    """{storage pointer: storage bytes} of the slabs under `bufs`."""
    return {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in bufs}


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.setattr(pinned_memory, "_warned", [])
    return monkeypatch


def test_pageable_when_not_pinning():
    bufs = host_buffers([3 * MIB + 5, 7], pin=False)
    assert [b.numel() for b in bufs] == [3 * MIB + 5, 7] and not any(b.is_pinned() for b in bufs)
    assert len(_slabs(bufs)) == 2                    # each its own tensor, nothing packed


@pytest.mark.parametrize("sizes", [
    [185 * MIB, 173 * MIB, 160 * MIB, 160 * MIB, 126 * MIB, 94 * MIB, 59 * MIB, 45 * MIB, 13 * MIB, 9 * MIB, 4 * MIB],
    [70 * MIB + 123, 62 * MIB, 70 * MIB + 123, 15 * MIB, 3, 640 * 2, 26 * MIB, 26 * MIB, 13 * MIB],
    [5],
])
def test_buffers_are_exact_aligned_disjoint_and_packed_into_power_of_two_slabs(unpinned, sizes):
    bufs = host_buffers(sizes, pin=True)
    assert [b.numel() for b in bufs] == sizes
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))          # no two overlap
    slabs = _slabs(bufs)
    assert all(n & (n - 1) == 0 for n in slabs.values())                          # torch would round anyway
    assert all((b.data_ptr() - b.untyped_storage().data_ptr()) % pinned_memory.ALIGN == 0 for b in bufs)
    smallest = max(SLAB_MIN, 1 << (max(sizes) - 1).bit_length())
    assert all(n <= 16 * smallest for n in slabs.values())
    # the point of packing: much less than one power of two per buffer
    separate = sum(1 << max(0, (n - 1).bit_length()) for n in sizes)
    assert sum(slabs.values()) <= separate
    if len(sizes) > 3:
        assert sum(slabs.values()) < 1.1 * sum(sizes), (sum(slabs.values()) / sum(sizes))


def test_blocks_just_over_half_a_slab_get_larger_slabs(unpinned):
    """SDXL's ~70 MB transformer blocks: one per 128 MiB slab would pin 1.8x their size."""
    sizes = [70 * MIB + 4096] * 30 + [62 * MIB] * 6
    bufs = host_buffers(sizes, pin=True)
    slabs = _slabs(bufs)
    assert sum(slabs.values()) < 1.1 * sum(sizes), sum(slabs.values()) / sum(sizes)
    assert max(slabs.values()) > 128 * MIB


def test_writing_one_buffer_leaves_its_neighbours(unpinned):
    bufs = host_buffers([MIB, MIB + 1, 300], pin=True)
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    assert all(bool((b == i + 1).all()) for i, b in enumerate(bufs))


def test_no_pinned_memory_falls_back_to_pageable_with_one_warning(unpinned, caplog):
    unpinned.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        a = host_buffers([2 * MIB], pin=True)
        b = host_buffers([2 * MIB], pin=True)
    assert a[0].numel() == b[0].numel() == 2 * MIB
    assert len([r for r in caplog.records if "pinned host memory unavailable" in r.getMessage()]) == 1
