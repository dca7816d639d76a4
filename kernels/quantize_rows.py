"""Per-row (per-token) FP8 e4m3 quantization, fused: each row's absolute maximum, then the row divided by its
scale, rounded to float8_e4m3fn, from one read of rows up to 4096 wide (two reads of wider ones).

`quantize_rows(x)` -> (q, scale): `x` [M, K] fp16/bf16/fp32, `q` [M, K] float8_e4m3fn, `scale` [M, 1] fp32 with
`x ~= q * scale`. The scale is amax / 448 (448: e4m3's largest finite value), so each row's largest element
lands on the format's largest value; a row of zeros gets a tiny positive scale, so it quantizes to zeros and
never divides by zero. These are the activation scales `torch._scaled_mm` takes as `scale_a` (rowwise).

Torch would need four passes over x for this (abs, amax, divide, cast) and a temporary the size of x; here the
row is read once (twice past 4096 columns) and the fp8 copy written once, all on the GPU, so it can run inside a
CUDA graph with no host sync.

`_quantize_rows_kernel` grid (row blocks,): BLOCK_M rows per program, held in registers whole (ONE_CHUNK) or
walked in BLOCK_K chunks twice.
"""
import torch

from ._dispatch import fused_op
from ._launch import launch
from ._tiling import cdiv, next_pow2, num_warps_for
from ._triton import device_dtype_ineligible, forward_only_ineligible, get_triton

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK_K = 4096   # columns per chunk of the row walk
_TILE = 8192          # elements a program holds: several rows of SD's widths, so no program is one short row
E4M3_MAX = 448.0      # float8_e4m3fn's largest finite value
MIN_SCALE = 1e-12     # a row of zeros: any positive scale quantizes it to zeros

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _round_to_e4m3(v):
        # v (fp32, |v| <= 448) rounded to nearest-even on e4m3's grid, so the cast that follows is exact on every
        # backend (Triton's CPU interpreter mis-rounds a mantissa carry into the exponent: 127.06 -> 64).
        # Normal range: keep 3 of fp32's 23 mantissa bits, carrying into the exponent as rounding does.
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        normal = bits.to(tl.float32, bitcast=True)
        # Subnormal range (|v| < 2**-6): multiples of 2**-9; adding 1.5 * 2**14, whose fp32 ulp is 2**-9, rounds so
        subnormal = (v + 24576.0) - 24576.0
        return tl.where(tl.abs(v) < 0.015625, subnormal, normal)

    @triton.jit
    def _quantize_rows_kernel(
        X,                  # input [M, K], rows `stride_x` elements apart, unit stride along K
        Q,                  # output [M, K] float8_e4m3fn, contiguous
        SCALE,              # output [M] fp32: amax / E4M3_MAX per row
        M, K, stride_x,
        FP8_MAX: tl.constexpr, MIN_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        ONE_CHUNK: tl.constexpr,    # K <= BLOCK_K: the rows are read once and quantized from registers
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        x_rows = X + rows.to(tl.int64)[:, None] * stride_x
        q_rows = Q + rows.to(tl.int64)[:, None] * K
        cols = tl.arange(0, BLOCK_K)
        if ONE_CHUNK:
            mask = row_ok[:, None] & (cols < K)[None, :]
            v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(v), axis=1) / FP8_MAX, MIN_S)
            q = _round_to_e4m3(tl.minimum(tl.maximum(v * (1.0 / scale)[:, None], -FP8_MAX), FP8_MAX))
            tl.store(q_rows + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
        else:
            amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
                v = tl.load(x_rows + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            scale = tl.maximum(tl.max(amax, axis=1) / FP8_MAX, MIN_S)
            inv = (1.0 / scale)[:, None]
            for k0 in range(0, K, BLOCK_K):
                mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
                v = tl.load(x_rows + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
                q = _round_to_e4m3(tl.minimum(tl.maximum(v * inv, -FP8_MAX), FP8_MAX))
                tl.store(q_rows + (k0 + cols)[None, :], q.to(Q.dtype.element_ty), mask=mask)
        tl.store(SCALE + rows, scale, mask=row_ok)


def _launch(x):
    M, K = x.shape
    q = torch.empty((M, K), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((M, 1), device=x.device, dtype=torch.float32)
    block_k = min(_MAX_BLOCK_K, next_pow2(K))
    block_m = max(1, min(_TILE // block_k, next_pow2(M)))
    launch(_quantize_rows_kernel, (cdiv(M, block_m),), x, q, scale, M, K, x.stride(0),
           FP8_MAX=E4M3_MAX, MIN_S=MIN_SCALE, BLOCK_M=block_m, BLOCK_K=block_k, ONE_CHUNK=K <= block_k,
           num_warps=num_warps_for(block_m * block_k))
    return q, scale


def eligible(x):
    """(True, "") when the Triton kernel takes `x`, else (False, why)."""
    why = device_dtype_ineligible(x, _DTYPES)
    if why:
        return False, why
    if x.dim() != 2:
        return False, "not 2-D"
    if x.shape[0] == 0 or x.shape[1] == 0:
        return False, "empty"
    if x.stride(1) != 1:
        return False, "rows not unit-stride"
    why = forward_only_ineligible(x)
    return (False, why) if why else (True, "")


@fused_op(eligible=eligible, launch=_launch)
def quantize_rows(x):
    """(q float8_e4m3fn [M, K], scale fp32 [M, 1]) of a 2-D `x`, `x ~= q * scale` row by row.

    Triton when `eligible`, else the reference; `quantize_rows.last_call` says which ran.
    """
    return (x,)


@quantize_rows.fallback
def quantize_rows_reference(x):
    """Plain torch, in fp32: per-row amax / 448, divided, clamped to e4m3's range, cast (round to nearest)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp_min(MIN_SCALE)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_tensor_reference(x):
    """One scale for the whole tensor (what tensorwise `_scaled_mm` takes): (q, scale fp32 0-d)."""
    xf = x.float()
    scale = (xf.abs().amax() / E4M3_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_weight_per_channel(w):
    """(q float8_e4m3fn [N, K], scale fp32 [1, N]) of a weight [N, K]: one scale per output channel (row).
    Run once per weight load or patch, so plain torch."""
    q, scale = quantize_rows_reference(w.reshape(w.shape[0], -1))
    return q, scale.reshape(1, -1)
