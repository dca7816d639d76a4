"""Residual add then LayerNorm over the last dim, forward only: `x = n + x; n = norm(x)` in one pass.

A transformer block adds each sub-layer's output to its residual stream and the next sub-layer starts by
normalizing that stream (SD's BasicTransformerBlock: attn1 -> add -> norm2 -> attn2 -> add -> norm3).
`add_layer_norm(a, r, ...)` returns (s, y) with s = a + r in the inputs' dtype, exactly as torch's add
rounds it, and y = LayerNorm(s) computed from that rounded s (fp32 statistics, two passes over the
registers: layer_norm.py's `normalize_rows`): what the add kernel and the norm kernel give one after the
other, with one read of the sum and one launch fewer. 32 launches fewer per SD1.5 step, 140 per SDXL step.
"""
import torch

from . import layer_norm as _ln
from ._dispatch import fused_op
from ._launch import launch
from ._tiling import cdiv, num_warps_for
from ._triton import forward_only_ineligible, get_triton

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt
    from .layer_norm import normalize_rows, row_tile

    @triton.jit
    def _add_layer_norm_kernel(
        A, R, S, Y,         # addends, sum, normalized sum [M, D], contiguous, one dtype
        W, B,               # weight / bias [D], any float dtype (ignored unless HAS_W / HAS_B)
        M, D, eps,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        offs, mask, cols, cmask = row_tile(M, D, BLOCK_M, BLOCK_D)
        s = (tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
             + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + offs, s, mask=mask)
        # the norm reads the rounded sum, as it would from memory; the same arithmetic as layer_norm's kernel
        y = normalize_rows(s.to(tl.float32), mask, cols, cmask, D, eps, W, B, HAS_W, HAS_B)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _launch(a, r, weight, bias, eps):
    M, D, block_m, block_d = _ln.row_tiles(a)
    s, y = torch.empty_like(a), torch.empty_like(a)
    launch(_add_layer_norm_kernel, (cdiv(M, block_m),),
        a, r, s, y, weight if weight is not None else y, bias if bias is not None else y, M, D, float(eps),
        HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=num_warps_for(block_m * block_d))
    return s, y


def eligible(a, r, normalized_shape, weight=None, bias=None):
    """(True, "") when the Triton kernel handles these arguments, else (False, why)."""
    if r.shape != a.shape or r.dtype != a.dtype or r.device != a.device:
        return False, "residual differs from the input in shape, dtype or device"
    if not r.is_contiguous():
        return False, "non-contiguous residual"
    why = forward_only_ineligible(r)
    if why:
        return False, why
    return _ln.eligible(a, normalized_shape, weight, bias)


@fused_op(eligible=eligible, launch=_launch)
def add_layer_norm(a, r, normalized_shape, weight=None, bias=None, eps=1e-5):
    """(a + r, F.layer_norm(a + r)) over the last dim, both in a's dtype. Triton when `eligible`, else the
    reference; `add_layer_norm.last_call` says which ran."""
    return a, r, normalized_shape, weight, bias, eps


@add_layer_norm.fallback
def add_layer_norm_reference(a, r, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Plain torch, in the inputs' dtype: torch's add, then layer_norm's reference on that sum."""
    s = a + r
    return s, _ln.layer_norm_reference(s, normalized_shape, weight, bias, eps)
