"""FreeU's skip-feature filter in two passes: the lowest Fourier modes of every (n, c) plane scaled by `scale`.

FreeU filters each skip connection in the frequency domain: a 2-D FFT of every plane in fp32, the centred
2·threshold × 2·threshold window of the shifted spectrum multiplied by `scale`, the inverse FFT's real part.
At threshold 1 (what ComfyUI's FreeU and FreeU_V2 nodes use) the window is the four modes (k, l) with k, l in
{0, -1}, so the filter is

    y = x + (scale - 1) · Re(the plane's projection on those four modes)
      = x + (scale - 1) / (H·W) · (S + A·cos a + B·sin a + C·cos b + D·sin b + E·cos(a+b) + F·sin(a+b))

with a = 2πh/H, b = 2πw/W at the output position and S, A..F the plane's sums of x, x·cos a, x·sin a,
x·cos b, x·sin b, x·cos(a+b), x·sin(a+b). (Taking the real part halves the change of a mode whose mirror image
lies outside the window: the mean is scaled by `scale`, the three other modes and their mirrors by (1 + scale)/2.)
Torch's way costs a dozen full passes over complex fp32 copies (the FFTs, two rolls, a mask as large as the
input); this one reads x twice and writes y once:

* `_plane_sums_kernel`, grid (splits of H·W, channel tiles, N): the seven sums of its part of each plane, fp32;
* the splits' partial sums added by torch (a fixed order: every run gives the same bits);
* `_apply_kernel`, grid (spatial tiles, channel tiles, N): y from x and the seven sums, one rounding to x's dtype.

x is addressed through its strides (NCHW, channels_last or any other 4-D layout); y has x's memory format (a
strided view's output is NCHW-contiguous, as torch's is).
The result equals torch's FFT filter to fp32 rounding (the FFT's own error is of the same order).
"""
import math

import torch

from ._dispatch import fused_op
from ._launch import launch
from ._tiling import cdiv, next_pow2, num_warps_for
from ._triton import device_dtype_ineligible, forward_only_ineligible, get_triton, is_channels_last

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SUMS = 7
_TILE = 4096          # elements per program
_MAX_SPLITS = 64
_PROGRAMS = 512       # the sums kernel's grid is split along H·W until it has about this many programs

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _basis(offs_s, H, W):
        h = offs_s // W
        w = offs_s - h * W
        a = h.to(tl.float32) * (6.283185307179586 / H)
        b = w.to(tl.float32) * (6.283185307179586 / W)
        ca, sa, cb, sb = tl.cos(a), tl.sin(a), tl.cos(b), tl.sin(b)
        return h, w, ca, sa, cb, sb, ca * cb - sa * sb, sa * cb + ca * sb

    @triton.jit
    def _plane_sums_kernel(
        X,                            # x, addressed through its strides
        P,                            # partial sums, fp32 [N, splits, 7, C]
        C, H, W, per_split, splits,
        sx_n, sx_c, sx_h, sx_w,
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        split = tl.program_id(0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        n = tl.program_id(2)
        cmask = offs_c < C
        S = H * W
        z = tl.zeros([BLOCK_C], dtype=tl.float32)
        s_sum, a_sum, b_sum, c_sum, d_sum, e_sum, f_sum = z, z, z, z, z, z, z
        start = split * per_split
        for s0 in range(start, start + per_split, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            smask = offs_s < S
            h, w, ca, sa, cb, sb, cab, sab = _basis(offs_s, H, W)
            offs = n * sx_n + h[:, None] * sx_h + w[:, None] * sx_w + offs_c[None, :] * sx_c
            x = tl.load(X + offs, mask=smask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            s_sum += tl.sum(x, 0)
            a_sum += tl.sum(x * ca[:, None], 0)
            b_sum += tl.sum(x * sa[:, None], 0)
            c_sum += tl.sum(x * cb[:, None], 0)
            d_sum += tl.sum(x * sb[:, None], 0)
            e_sum += tl.sum(x * cab[:, None], 0)
            f_sum += tl.sum(x * sab[:, None], 0)
        out = P + ((n * splits + split) * 7) * C + offs_c
        tl.store(out, s_sum, mask=cmask)
        tl.store(out + C, a_sum, mask=cmask)
        tl.store(out + 2 * C, b_sum, mask=cmask)
        tl.store(out + 3 * C, c_sum, mask=cmask)
        tl.store(out + 4 * C, d_sum, mask=cmask)
        tl.store(out + 5 * C, e_sum, mask=cmask)
        tl.store(out + 6 * C, f_sum, mask=cmask)

    @triton.jit
    def _apply_kernel(
        X, Q, Y,                      # x; the sums, fp32 [N, 7, C]; y
        C, H, W, factor,              # factor: (scale - 1) / (H·W)
        sx_n, sx_c, sx_h, sx_w,
        sy_n, sy_c, sy_h, sy_w,
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        n = tl.program_id(2)
        cmask = offs_c < C
        smask = offs_s < H * W
        q = Q + n * 7 * C + offs_c
        s_sum = tl.load(q, mask=cmask, other=0.0)
        a_sum = tl.load(q + C, mask=cmask, other=0.0)
        b_sum = tl.load(q + 2 * C, mask=cmask, other=0.0)
        c_sum = tl.load(q + 3 * C, mask=cmask, other=0.0)
        d_sum = tl.load(q + 4 * C, mask=cmask, other=0.0)
        e_sum = tl.load(q + 5 * C, mask=cmask, other=0.0)
        f_sum = tl.load(q + 6 * C, mask=cmask, other=0.0)
        h, w, ca, sa, cb, sb, cab, sab = _basis(offs_s, H, W)
        low = (s_sum[None, :] + a_sum[None, :] * ca[:, None] + b_sum[None, :] * sa[:, None]
               + c_sum[None, :] * cb[:, None] + d_sum[None, :] * sb[:, None]
               + e_sum[None, :] * cab[:, None] + f_sum[None, :] * sab[:, None])
        offs = n * sx_n + h[:, None] * sx_h + w[:, None] * sx_w + offs_c[None, :] * sx_c
        mask = smask[:, None] & cmask[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        offs_y = n * sy_n + h[:, None] * sy_h + w[:, None] * sy_w + offs_c[None, :] * sy_c
        tl.store(Y + offs_y, (x + factor * low).to(Y.dtype.element_ty), mask=mask)


def _tile(C, S, channels_last):
    """(BLOCK_S, BLOCK_C), long along x's contiguous axis."""
    if channels_last:
        block_c = max(2, min(64, next_pow2(C)))
        return max(2, min(_TILE // block_c, next_pow2(S))), block_c
    block_s = max(2, min(next_pow2(S), 256))
    return block_s, max(2, min(_TILE // block_s, next_pow2(C)))


def _launch(x, threshold, scale):
    N, C, H, W = x.shape
    S = H * W
    block_s, block_c = _tile(C, S, is_channels_last(x))
    c_tiles, s_tiles = cdiv(C, block_c), cdiv(S, block_s)
    splits = max(1, min(_MAX_SPLITS, s_tiles, cdiv(_PROGRAMS, N * c_tiles)))
    per_split = cdiv(s_tiles, splits) * block_s
    splits = cdiv(S, per_split)
    partial = torch.empty((N, splits, _SUMS, C), device=x.device, dtype=torch.float32)
    warps = num_warps_for(block_s * block_c)
    launch(_plane_sums_kernel, (splits, c_tiles, N), x, partial, C, H, W, per_split, splits, *x.stride(),
           BLOCK_S=block_s, BLOCK_C=block_c, num_warps=warps)
    sums = partial.sum(dim=1)
    y = torch.empty_like(x)   # x's strides where x is dense, else NCHW-contiguous
    launch(_apply_kernel, (s_tiles, c_tiles, N), x, sums, y, C, H, W, (float(scale) - 1.0) / S, *x.stride(),
           *y.stride(),
           BLOCK_S=block_s, BLOCK_C=block_c, num_warps=warps)
    return y


def eligible(x, threshold, scale):
    """(True, "") when the kernels compute this filter, else (False, why)."""
    why = device_dtype_ineligible(x, _DTYPES)
    if why:
        return False, why
    if threshold != 1:
        return False, "threshold %r (the kernels take FreeU's 1)" % (threshold,)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        return False, "scale not a finite number"
    if x.dim() != 4:
        return False, "%d-D input" % x.dim()
    if x.shape[2] < 2 or x.shape[3] < 2:
        return False, "a side under 2 (the window then holds fewer modes)"
    if x.numel() == 0 or min(x.stride()) < 0:
        return False, "empty or negatively strided input"
    if sum((n - 1) * s for n, s in zip(x.shape, x.stride())) >= 2**31 or x.shape[0] > 65535:
        return False, "too large for int32 offsets or the grid"
    why = forward_only_ineligible(x)
    if why:
        return False, why
    return True, ""


@fused_op(eligible=eligible, launch=_launch)
def fourier_low_scale(x, threshold=1, scale=1.0):
    """FreeU's filter of `x` [N, C, H, W]: the centred 2·threshold-wide window of each plane's shifted spectrum
    scaled by `scale`, in x's dtype and memory format. The kernels take threshold 1; anything else runs the
    reference. `fourier_low_scale.last_call` says which ran."""
    return x, threshold, scale


@fourier_low_scale.fallback
def _reference_in_x_format(x, threshold, scale):
    y = fourier_low_scale_reference(x, threshold, scale)
    return y.contiguous(memory_format=torch.channels_last) if is_channels_last(x) else y


def fourier_low_scale_reference(x, threshold=1, scale=1.0):
    """Plain torch, the way FreeU defines the filter: an fp32 FFT of each plane, shifted so that the mean is at
    the centre, the centred window scaled (by Python's slice rules, as FreeU's mask: a start below 0 counts from
    the end), the inverse FFT's real part in x's dtype. No host-to-device copy: a step may be captured around it."""
    dims = (-2, -1)
    spectrum = torch.fft.fftshift(torch.fft.fft2(x.float()), dim=dims)
    row, col = x.shape[-2] // 2, x.shape[-1] // 2
    spectrum[..., row - threshold:row + threshold, col - threshold:col + threshold] *= scale
    return torch.fft.ifft2(torch.fft.ifftshift(spectrum, dim=dims)).real.to(x.dtype)
