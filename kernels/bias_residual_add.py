"""`residual + (x + bias[c])` in one pass, forward only: the end of every SD ResBlock.

A ResBlock ends with `skip_connection(x) + out_layers(h)`, whose last step is a convolution with a bias.
Torch adds a convolution's bias in a kernel of its own (a broadcast `add_([N, C, H, W], [1, C, 1, 1])`,
slow and not vectorised on channels_last), then the residual add is another full pass. Running the
convolution without its bias and calling this op instead reads the conv output and the residual once
and writes the sum once. A second per-channel bias (`residual_bias`, the skip connection's 1x1 conv
when it has one) costs nothing more.

`_bias_residual_add_kernel` grid (spatial tiles, channel tiles, N): a [BLOCK_S, BLOCK_C] tile, x and
the output addressed as (N, C, S) through x's strides, the residual through its own, so NCHW and
channels_last (and a residual in the other format) share the kernel; the tile's long side runs along
x's contiguous axis. Sums in fp32, one rounding to x's dtype. The output has x's strides and may be x
itself (`out=x`: x is a temporary its caller owns).
"""
import torch

from ._dispatch import fused_op
from ._launch import launch
from ._tiling import cdiv, next_pow2, num_warps_for
from ._triton import (activation_ineligible, forward_only_ineligible, get_triton, is_channels_last,
                      vectors_ineligible)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE = 2048     # output elements per program (three loads per element: x, residual, and the biases)

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _bias_residual_add_kernel(
        X,                              # x (the conv output without its bias), read as (N, C, S)
        R,                              # residual, same shape, its own strides
        B, RB,                          # per-channel biases [C], any float dtype (ignored unless HAS_B / HAS_RB)
        Y,                              # output, x's strides (may be X: each element is read before it is written)
        C, S,                           # channels, spatial positions (H * W, or L)
        sx_n, sx_c, sx_s,               # element strides of x and y (NCHW: C*S, S, 1; channels_last: S*C, 1, C)
        sr_n, sr_c, sr_s,               # element strides of the residual
        HAS_B: tl.constexpr, HAS_RB: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid_s = tl.program_id(0)
        pid_c = tl.program_id(1)
        n = tl.program_id(2)
        offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = offs_c < C
        mask = (offs_s < S)[:, None] & cmask[None, :]
        offs_x = n * sx_n + offs_s[:, None] * sx_s + offs_c[None, :] * sx_c
        offs_r = n * sr_n + offs_s[:, None] * sr_s + offs_c[None, :] * sr_c
        x = tl.load(X + offs_x, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        r = tl.load(R + offs_r, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_B:
            x += tl.load(B + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_RB:
            r += tl.load(RB + offs_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_x, (r + x).to(Y.dtype.element_ty), mask=mask)


def _ncs_strides(t):
    """(stride_n, stride_c, stride_s) addressing a 3-D (N, C, L) or 4-D (N, C, H, W) tensor as (N, C, S),
    or None when H and W cannot be walked as one axis (a crop, a transposed H/W)."""
    if t.dim() == 3:
        return tuple(t.stride())
    if t.dim() != 4:
        return None
    sn, sc, sh, sw = t.stride()
    H, W = t.shape[2], t.shape[3]
    if W == 1:
        return sn, sc, sh
    if H == 1 or sh == W * sw:
        return sn, sc, sw
    return None


def _overlaps(t, out):
    """True when `t` shares memory with `out` without being the same elements (an in-place call may
    only write where it reads)."""
    if t.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
        return False
    return t.data_ptr() != out.data_ptr() or t.stride() != out.stride()


def _max_offset(t):
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _config(C, S, channels_last):
    """Tile shape (BLOCK_S spatial x BLOCK_C channels), long along x's contiguous axis."""
    if channels_last:
        block_c = 128 if C % 128 == 0 else 64 if C % 64 == 0 else max(2, min(128, next_pow2(C)))
        block_s = max(2, min(_TILE // block_c, next_pow2(S)))
    else:
        block_s = max(2, min(next_pow2(S), 1024, _TILE))
        block_c = max(2, min(_TILE // block_s, next_pow2(C)))
    return block_s, block_c


def _launch(x, residual, bias, residual_bias, out):
    N, C = x.shape[0], x.shape[1]
    S = x.numel() // (N * C)
    cl = is_channels_last(x)
    sx = (S * C, 1, C) if cl else (C * S, S, 1)
    block_s, block_c = _config(C, S, cl)
    y = torch.empty_like(x) if out is None else out   # preserve_format: x's strides
    launch(_bias_residual_add_kernel, (cdiv(S, block_s), cdiv(C, block_c), N),
        x, residual, bias if bias is not None else x, residual_bias if residual_bias is not None else x, y,
        C, S, *sx, *_ncs_strides(residual),
        HAS_B=bias is not None, HAS_RB=residual_bias is not None,
        BLOCK_S=block_s, BLOCK_C=block_c, num_warps=num_warps_for(block_s * block_c))
    return y


def eligible(x, residual, bias=None, residual_bias=None, out=None):
    """(True, "") when the Triton kernel handles these arguments, else (False, why)."""
    why = activation_ineligible(x, _DTYPES)
    if why:
        return False, why
    if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
        return False, "residual not of x's shape (no broadcasting)"
    if residual.dtype != x.dtype or residual.device != x.device:
        return False, "residual of another dtype or device"
    if _ncs_strides(residual) is None or min(residual.stride()) < 0 or _max_offset(residual) >= 2**31:
        return False, "residual layout not addressable as (N, C, H*W)"
    why = vectors_ineligible(x, x.shape[1], "C", bias=bias, residual_bias=residual_bias)
    if why:
        return False, why
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
                            or out.stride() != x.stride()):
        return False, "out not of x's shape, dtype and strides"
    if out is not None and any(_overlaps(t, out) for t in (x, residual)):
        return False, "out overlaps an input other than element for element"
    why = forward_only_ineligible(x, residual, bias, residual_bias)
    if why:
        return False, why
    return True, ""


@fused_op(eligible=eligible, launch=_launch)
def bias_residual_add(x, residual, bias=None, residual_bias=None, out=None):
    """`(residual + residual_bias[c]) + (x + bias[c])` for x, residual of shape (N, C, ...) and biases [C].

    The output has x's dtype and memory format; `out` (optional) receives it, and may be x itself.
    Runs the Triton kernel when `eligible`, else the reference; `bias_residual_add.last_call` says which ran.
    """
    return x, residual, bias, residual_bias, out


@bias_residual_add.fallback
def _reference_as_kernel_writes(x, residual, bias, residual_bias, out):
    y = bias_residual_add_reference(x, residual, bias, residual_bias)
    if out is not None:
        return out.copy_(y)
    if is_channels_last(x) and not y.is_contiguous(memory_format=torch.channels_last):
        y = y.contiguous(memory_format=torch.channels_last)
    elif x.is_contiguous() and not y.is_contiguous():
        y = y.contiguous()
    return y


def _per_channel(p, x):
    return p.to(x.dtype).reshape((1, -1) + (1,) * (x.dim() - 2))


def bias_residual_add_reference(x, residual, bias=None, residual_bias=None):
    """Plain torch, in x's dtype, in the host's order: the convolutions add their biases (cast to the
    activation's dtype, as ComfyUI's ops do), then `skip_connection(x) + h`."""
    if bias is not None:
        x = x + _per_channel(bias, x)
    if residual_bias is not None:
        residual = residual + _per_channel(residual_bias, residual)
    return residual + x
