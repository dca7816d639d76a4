"""GEGLU fused, forward only: `a, gate = h.chunk(2, -1); a * gelu(gate)` with exact (erf) GELU, as in
ldm's and ComfyUI's `GEGLU` feed-forward of every SD transformer block.

Torch runs this as chunk + gelu + mul: two kernels, an intermediate gelu(gate) written and read back.
The fused kernel reads each half once, computes in fp32 and writes the (..., D) output once.

`_geglu_kernel` grid (row tiles, column tiles): a [BLOCK_M, BLOCK_N] tile of the output; BLOCK_N is a
power of two dividing D where one exists (SD's D = 1280, 2560, 5120), so no lanes are masked off.
"""
import torch
import torch.nn.functional as F

from ._dispatch import fused_op
from ._launch import launch
from ._tiling import cdiv, next_pow2, num_warps_for
from ._triton import dense_ineligible, device_dtype_ineligible, forward_only_ineligible, get_triton

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE = 4096  # output elements per program (it reads twice that)

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _geglu_kernel(
        H,                  # input [M, 2 * D], row-major contiguous: columns [0, D) = a, [D, 2D) = gate
        OUT,                # output [M, D], contiguous
        M, D,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < D)[None, :]
        in_offs = rows[:, None] * (2 * D) + cols[None, :]
        a = tl.load(H + in_offs, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(H + in_offs + D, mask=mask, other=0.0).to(tl.float32)
        gelu = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))  # exact GELU
        out = a * gelu
        tl.store(OUT + rows[:, None] * D + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def _config(M, D):
    block_n = next((b for b in (1024, 512, 256, 128) if D % b == 0), min(1024, next_pow2(D)))
    block_n = max(2, block_n)
    block_m = max(2, min(_TILE // block_n, next_pow2(M)))
    return block_m, block_n


def _launch(h):
    D = h.shape[-1] // 2
    M = h.numel() // (2 * D)
    out = torch.empty(h.shape[:-1] + (D,), device=h.device, dtype=h.dtype)
    block_m, block_n = _config(M, D)
    launch(_geglu_kernel, (cdiv(M, block_m), cdiv(D, block_n)),
        h, out, M, D, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps_for(block_m * block_n))
    return out


def eligible(h):
    """(True, "") when the Triton kernel handles `h`, else (False, why)."""
    why = device_dtype_ineligible(h, _DTYPES)
    if why:
        return False, why
    if h.dim() < 1 or h.shape[-1] % 2:
        return False, "last dim not even"
    why = dense_ineligible(h) or forward_only_ineligible(h)
    if why:
        return False, why
    return True, ""


@fused_op(eligible=eligible, launch=_launch)
def geglu(h):
    """a * gelu(gate) for `a, gate = h.chunk(2, -1)`; contiguous (..., D) output in h's dtype.

    Triton when `eligible`, else the reference; `geglu.last_call` says which ran.
    """
    return (h,)


@geglu.fallback
def _reference_contiguous(h):
    return geglu_reference(h).contiguous()


def geglu_reference(h):
    """Plain torch, in h's dtype, exactly as ldm / ComfyUI's GEGLU after its projection."""
    a, gate = h.chunk(2, dim=-1)
    return a * F.gelu(gate)
