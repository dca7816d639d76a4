"""LayerNorm over the last dim, forward only: norm1/2/3 of every SD transformer block.

SD's widths (D = 320 ... 1280) fit a whole row in registers, so `_layer_norm_kernel` loads a
[BLOCK_M, BLOCK_D] tile of BLOCK_M rows once, takes fp32 mean and variance from the registers
(two-pass over the tile: no E[x^2] - E[x]^2 cancellation), and writes the normalized rows: one read
and one write of x. grid (row tiles,); BLOCK_D = next power of two >= D, BLOCK_M fills ~4096 elements.
"""
import torch
import torch.nn.functional as F

from ._dispatch import fused_op
from ._launch import launch
from ._tiling import cdiv, next_pow2, num_warps_for
from ._triton import dense_ineligible, device_dtype_ineligible, forward_only_ineligible, get_triton, vectors_ineligible

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE = 4096
_MAX_D = 8192  # a whole row per tile; wider rows fall back

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def row_tile(M, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's [BLOCK_M, BLOCK_D] tile of a contiguous [M, D]: (offsets, mask, cols, column mask).
        Shared with add_layer_norm.py's kernel."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = (rows < M)[:, None] & cmask[None, :]
        return rows[:, None] * D + cols[None, :], mask, cols, cmask

    @triton.jit
    def normalize_rows(x, mask, cols, cmask, D, eps, W, B, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
        """fp32 [BLOCK_M, BLOCK_D] tile `x` (masked lanes 0) -> its rows normalized, times W, plus B (fp32).
        Shared with add_layer_norm.py's kernel."""
        mean = tl.sum(x, axis=1) / D
        d = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / D + eps)
        y = d * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        return y

    @triton.jit
    def _layer_norm_kernel(
        X, Y,               # input / output [M, D], contiguous
        W, B,               # weight / bias [D], any float dtype (ignored unless HAS_W / HAS_B)
        M, D, eps,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        offs, mask, cols, cmask = row_tile(M, D, BLOCK_M, BLOCK_D)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        y = normalize_rows(x, mask, cols, cmask, D, eps, W, B, HAS_W, HAS_B)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _normalized_dim(normalized_shape):
    if isinstance(normalized_shape, int):
        return normalized_shape
    shape = tuple(normalized_shape)
    return shape[0] if len(shape) == 1 else None


def row_tiles(x):
    """(M, D, block_m, block_d): contiguous `x` as M rows of D, tiled in whole rows (block_d, a power of two,
    >= D) of about _TILE elements. Shared with add_layer_norm.py's launcher."""
    D = x.shape[-1]
    M = x.numel() // D
    block_d = max(2, next_pow2(D))
    return M, D, max(2, min(_TILE // block_d, next_pow2(M))), block_d


def _launch(x, weight, bias, eps):
    M, D, block_m, block_d = row_tiles(x)
    y = torch.empty_like(x)
    launch(_layer_norm_kernel, (cdiv(M, block_m),),
        x, y, weight if weight is not None else y, bias if bias is not None else y, M, D, float(eps),
        HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=num_warps_for(block_m * block_d))
    return y


def eligible(x, normalized_shape, weight=None, bias=None):
    """(True, "") when the Triton kernel handles these arguments, else (False, why)."""
    why = device_dtype_ineligible(x, _DTYPES)
    if why:
        return False, why
    D = _normalized_dim(normalized_shape)
    if x.dim() < 1 or D is None or x.shape[-1] != D:
        return False, "normalized_shape is not (x.shape[-1],)"
    if D > _MAX_D:
        return False, f"D={D} > {_MAX_D}"
    why = (dense_ineligible(x) or vectors_ineligible(x, D, "D", weight=weight, bias=bias)
           or forward_only_ineligible(x, weight, bias))
    if why:
        return False, why
    return True, ""


@fused_op(eligible=eligible, launch=_launch)
def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """F.layer_norm over the last dim; output in x's dtype. Triton when `eligible`, else the reference;
    `layer_norm.last_call` says which ran."""
    if not x.is_contiguous():
        # torch's own layer_norm makes this same copy (expect_contiguous); A1111's ldm hands the first
        # norm of each transformer block a rearranged, non-contiguous view
        x = x.contiguous()
    return x, normalized_shape, weight, bias, eps


@layer_norm.fallback
def layer_norm_reference(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Plain torch, in x's dtype: weight and bias are cast to it first, as ComfyUI's ops do."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if x.is_floating_point():
        weight = weight.to(x.dtype) if weight is not None else None
        bias = bias.to(x.dtype) if bias is not None else None
    return F.layer_norm(x, tuple(normalized_shape), weight, bias, eps)
