"""Host buffers for weights that travel to the GPU: pinned, packed into few allocations. Host-agnostic.

torch's pinned allocator (`pin_memory=True`) rounds every request up to the next power of two: an SDXL
transformer block's 70 MB of weights pinned 128 MB, a 26 MB weight 32 MB. Here the buffers asked for together
(a streamer's blocks, a model's weights on their way off the GPU) are packed, largest first, into slabs, each
one pinned allocation whose size is already a power of two (no hidden rounding): of the slab sizes from
SLAB_MIN (or the largest buffer's power of two) up to 16 times that, the one that allocates least, each slab
shrunk to the power of two its contents need. A buffer is a
view of its slab, so the slab lives as long as any of its buffers does; copies from a view are copies from
pinned memory (torch checks a tensor's storage, the slab), full speed and capturable in a CUDA graph.

(Exactly sized buffers through `cudaHostRegister` were tried first, device run 61: torch 2.11 does not count
registered memory as pinned, so a CUDA graph refused to capture copies from it.)
"""
import logging

import torch

from ...kernels.errors import first_line

log = logging.getLogger("sd_accel")

SLAB_MIN = 64 << 20     # a slab holds many small buffers; a larger buffer gets a slab of its power of two
ALIGN = 256             # every buffer starts at a multiple of this many bytes in its slab
_warned = []


def nbytes(t):
    return t.numel() * t.element_size()


def aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def view_as(flat, offset, like):
    """A tensor of `like`'s shape, dtype and (dense) strides over `flat` (uint8) from byte `offset`:
    channels_last conv weights stay channels_last; any other layout becomes contiguous."""
    typed = flat[offset:offset + nbytes(like)].view(like.dtype)
    if like.is_contiguous() or like.is_contiguous(memory_format=torch.channels_last):
        return typed.as_strided(like.shape, like.stride())
    return typed.view(like.shape)


def _pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


def _allocate(n, pin):
    if pin:
        try:
            return torch.empty(n, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:      # no CUDA driver, or the host's pinned-memory limit: pageable, slower
            if not _warned:
                _warned.append(str(e))
                log.warning("SD Accel: pinned host memory unavailable (%s); using pageable memory "
                            "(slower copies to the GPU)", first_line(e, 10 ** 9))
    return torch.empty(n, dtype=torch.uint8)


def _pack(sizes, slab):
    """First fit, largest first, into bins of `slab` bytes: [[(index, offset)], ...]."""
    bins = []                                   # [bytes used, [(index, offset)]]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        need = aligned(sizes[i])
        for b in bins:
            if b[0] + need <= slab:
                b[1].append((i, b[0]))
                b[0] += need
                break
        else:
            bins.append([need, [(i, 0)]])
    # the last buffer of a bin needs no alignment padding: each bin's allocation is the power of two of its end
    return [(items, _pow2(max(off + sizes[i] for i, off in items))) for _, items in bins]


def host_buffers(sizes, pin):
    """One uint8 host buffer per entry of `sizes` (bytes), in that order: views of pinned slabs when `pin`
    (see the module doc), else plain pageable tensors of their own."""
    sizes = [int(n) for n in sizes]
    if not pin:
        return [torch.empty(n, dtype=torch.uint8) for n in sizes]
    if not sizes:
        return []
    # the slab size that allocates least: SDXL's 70 MB transformer blocks fill 128 MiB slabs one each (1.8x)
    # but 512 MiB ones seven each (1.04x); among equals the smaller slabs (freed sooner)
    smallest = max(SLAB_MIN, _pow2(aligned(max(sizes))))
    cap = max(smallest, _pow2(sum(aligned(n) for n in sizes)))
    plans, slab = [], smallest
    while slab <= min(cap, smallest << 4):
        plans.append(_pack(sizes, slab))
        slab <<= 1
    plan = min(plans, key=lambda bins: sum(n for _, n in bins))
    out = [None] * len(sizes)
    for items, n in plan:
        buf = _allocate(n, pin)
        for i, off in items:
            out[i] = buf[off:off + sizes[i]]
    return out
