"""Many fp8 tensors cast to one wider float dtype by one kernel, into one destination buffer.

ComfyUI computes an fp8-stored layer by casting its weight to the input's dtype at every call: one small
kernel (and a Python call) per layer, several hundred per UNet step. Here a group of weights is cast at once:
each source is copied, in its storage order, to its own BLOCK-aligned slice of `dst`, and a view of that slice
with the source's strides (`Layout.view`) is the cast weight, channels_last convolution weights included. fp8
e4m3 and e5m2 values are all exactly representable in fp16, bf16 and fp32, so the cast is exact.

The kernel reads the sources through a table of their addresses (`pointer_table`), built outside any CUDA graph
capture: a graph replays with the addresses of its capture, so a table is never rewritten (a new set of weights
gets a new table). `Layout` (where each source lands) depends only on the sources' sizes.

`_upcast_kernel` grid (tiles of `dst`,): a tile lies inside one source's slice (slices start at multiples of
BLOCK); `TILE_SOURCE[tile]` names it.
"""
import torch

from ._dispatch import fused_op
from ._launch import launch
from ._tiling import cdiv
from ._triton import device_dtype_ineligible, get_triton

BLOCK = 1024            # codes a program casts; every slice of `dst` starts at a multiple of it
NUM_WARPS = 4           # with BLOCK, 8 codes a thread: the fastest in bench_upcast_fp8 --sweep (2 warps ~the same)
_SOURCE_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_DST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ALIGN = 16             # bytes: the kernel reads each source in 16-byte vectors

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _decode(b, E5M2: tl.constexpr):
        """fp8 codes (int32 0..255) to their values in fp32: decoded from the bits, not by an fp8 type, so exact on
        every GPU Triton runs on (its fp8 types need sm_89) and in its CPU interpreter (whose fp8 conversions miss
        e5m2's subnormals and infinities)."""
        if E5M2:
            # e5m2 is fp16's top byte: infinities, NaNs and subnormals included
            return (b << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        # e4m3fn's sign bit and 7 magnitude bits placed as fp16's sign, exponent and top mantissa bits give its
        # value / 256 (normal and subnormal alike; the sign set in the bits, not by a negation a compiler may fold
        # for a zero, so -0.0 stays negative); its only non-finite codes are the NaNs 0x7F and 0xFF
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return tl.where((b & 0x7F) == 0x7F, float("nan"), v)

    @triton.jit
    def _upcast_kernel(
        TILE_SOURCE,        # int32 [tiles]: which source the tile belongs to
        SOURCES,            # int64 [sources]: each source's address
        STARTS,             # int64 [sources]: where each source's slice starts in DST (elements, multiple of BLOCK)
        NUMELS,             # int64 [sources]
        DST,                # [total] fp16 / bf16 / fp32
        E5M2: tl.constexpr, BLOCK: tl.constexpr,
    ):
        tile = tl.program_id(0)
        s = tl.load(TILE_SOURCE + tile)
        src = tl.multiple_of(tl.load(SOURCES + s).to(tl.pointer_type(tl.uint8)), 16)
        start = tl.multiple_of(tl.load(STARTS + s), BLOCK)
        n = tl.load(NUMELS + s)
        base = tl.multiple_of(tile.to(tl.int64) * BLOCK - start, BLOCK)     # the tile's first code in the source
        local = base + tl.arange(0, BLOCK)
        out = DST + start + local
        if base + BLOCK <= n:
            # a whole tile: unmasked, so each thread's codes load and store as wide vectors
            v = _decode(tl.load(src + local).to(tl.int32), E5M2)
            tl.store(out, v.to(DST.dtype.element_ty))
        else:
            v = _decode(tl.load(src + local, mask=local < n, other=0).to(tl.int32), E5M2)
            tl.store(out, v.to(DST.dtype.element_ty), mask=local < n)


class Layout:
    """Where each of a group's sources lands in the destination: slices in order, each starting at a multiple of
    `block` (the kernel's tile: BLOCK, another power of two >= 64 where a benchmark sweeps it). `numels`: the
    sources' sizes. The device tables are made at construction (outside any capture)."""

    def __init__(self, numels, device, block=BLOCK):
        self.numels, self.block = tuple(int(n) for n in numels), block
        starts, tile_source, at = [], [], 0
        for i, n in enumerate(self.numels):
            starts.append(at)
            tiles = cdiv(n, block)
            tile_source += [i] * tiles
            at += tiles * block
        self.starts, self.total = tuple(starts), at
        self.tile_source = torch.tensor(tile_source, dtype=torch.int32, device=device)
        self.starts_dev = torch.tensor(starts, dtype=torch.int64, device=device)
        self.numels_dev = torch.tensor(self.numels, dtype=torch.int64, device=device)

    def view(self, dst, i, like):
        """Source `i`'s cast copy in `dst`: `like`'s shape and strides (its storage order is what was copied)."""
        return dst.as_strided(like.shape, like.stride(), self.starts[i])


def pointer_table(sources, device):
    """int64 [sources] of the sources' addresses, on `device` (outside a capture: a host-to-device copy)."""
    return torch.tensor([t.data_ptr() for t in sources], dtype=torch.int64, device=device)


def sources_ineligible(sources):
    """Why `sources` cannot be one group's sources (None when they can): one fp8 dtype, each dense (contiguous or
    channels_last) and 16-byte aligned."""
    if not sources:
        return "no sources"
    dtype = sources[0].dtype
    for t in sources:
        if t.dtype not in _SOURCE_DTYPES or t.dtype != dtype:
            return "sources not all of one fp8 dtype"
        if not _dense(t) or t.data_ptr() % _ALIGN:
            return "a source not dense or not 16-byte aligned"
    return None


def _dense(t):
    """Contiguous, or a channels_last 4-D tensor: its elements fill its storage span from its address on."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def eligible(sources, dst, layout):
    why = device_dtype_ineligible(dst, _DST_DTYPES)
    if why:
        return False, why
    if any(t.device != dst.device for t in sources):
        return False, "a source on another device"
    return True, ""


def _launch(sources, dst, layout, pointers):
    launch(_upcast_kernel, (len(layout.tile_source),), layout.tile_source, pointers, layout.starts_dev,
           layout.numels_dev, dst, E5M2=sources[0].dtype == getattr(torch, "float8_e5m2", None), BLOCK=layout.block,
           num_warps=NUM_WARPS)
    return dst


@fused_op(eligible=eligible, launch=_launch)
def upcast_fp8(sources, dst, layout, pointers):
    """Casts each of `sources` (fp8, `sources_ineligible` None) into its slice of `dst` ([layout.total], the
    wider dtype); `pointers`: their `pointer_table`. Returns `dst`. Triton when `eligible`, else the reference;
    `upcast_fp8.last_call` says which ran."""
    return (sources, dst, layout, pointers)


@upcast_fp8.fallback
def upcast_fp8_reference(sources, dst, layout):
    for t, start in zip(sources, layout.starts):
        dst[start:start + t.numel()].copy_(t.as_strided((t.numel(),), (1,)))
    return dst
