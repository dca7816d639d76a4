"""FP8 e4m3 GEMM with its epilogue fused: `out = (xq @ wq.T) * xs * ws + bias` in fp16, and optionally GEGLU's
`value * gelu(gate)` over the two halves of the product, for precision "fp8" (LOSSY: engine/fp8).

`torch._scaled_mm` takes per-row activation and per-channel weight scales only with a bfloat16 output on
sm_89/sm_90, so an fp16 model pays a cast and a bias add afterwards: two more passes over the output, which cost
about what FP8 saves in the GEMM. Here the fp32 accumulator is scaled, biased and written once, in fp16; with
`geglu` the program accumulates the value and the gate columns of the same output columns side by side and writes
only `value * gelu(gate)`, so the feed-forward's [M, 2D] projection is never written nor read back.

`fp8_gemm(xq, xs, wq, ws, bias, geglu)`:
  xq [M, K] float8_e4m3fn (rows unit-stride), xs [M, 1] fp32: activations, x ~= xq * xs (kernels/quantize_rows.py)
  wq [N, K] float8_e4m3fn contiguous, ws [1, N] fp32: the weight, w ~= wq * ws.T, one scale per output channel
  bias [N] fp16 or None
  -> [M, N] fp16, or [M, N // 2] with geglu (value rows [0, N/2), gate rows [N/2, N), as ComfyUI's GEGLU chunks).

`_fp8_gemm_kernel` grid (tiles,): one [BLOCK_M, BLOCK_N] output tile per program, tiles ordered in groups of
GROUP_M rows of tiles so that neighbouring programs share weight tiles in L2. Both operands are K-major, which
is what Hopper's FP8 tensor-core instructions read.
"""
import torch
import torch.nn.functional as F

from ._dispatch import fused_op
from ._launch import launch
from ._tiling import cdiv
from ._triton import device_dtype_ineligible, forward_only_ineligible, get_triton

FP8 = getattr(torch, "float8_e4m3fn", None)
GROUP_M = 8

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _fp8_gemm_kernel(
        A,                  # activations [M, K] float8_e4m3fn, rows `stride_am` apart, unit stride along K
        XS,                 # [M] fp32: activation scale per row
        B,                  # weight [N_ALL, K] float8_e4m3fn, contiguous (K-major)
        WS,                 # [N_ALL] fp32: weight scale per output channel
        BIAS,               # [N_ALL] fp16 (read only when HAS_BIAS)
        C,                  # output [M, N] fp16, contiguous (N = N_ALL, or N_ALL / 2 with GEGLU)
        M, N, K, stride_am,
        HAS_BIAS: tl.constexpr, GEGLU: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP * tiles_n
        first_m = (pid // in_group) * GROUP
        group_rows = min(tiles_m - first_m, GROUP)
        pid_m = first_m + (pid % in_group) % group_rows
        pid_n = (pid % in_group) // group_rows

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # loads wrap around at the edges (rows % M): every lane reads a valid address, the store masks them off
        a_rows = rows % M
        b_cols = cols % N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A + a_rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        b_ptrs = B + b_cols[None, :].to(tl.int64) * K + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GEGLU:
            g_ptrs = b_ptrs + N.to(tl.int64) * K      # the gate half's rows, N rows further down
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = (k0 + ks) < K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            if GEGLU:
                if EVEN_K:
                    g = tl.load(g_ptrs)
                else:
                    g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
                acc_g = tl.dot(a, g, acc_g)
                g_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        xs = tl.load(XS + a_rows)[:, None]
        out = acc * xs * tl.load(WS + b_cols)[None, :]
        if HAS_BIAS:
            out += tl.load(BIAS + b_cols).to(tl.float32)[None, :]
        if GEGLU:
            gate = acc_g * xs * tl.load(WS + N + b_cols)[None, :]
            if HAS_BIAS:
                gate += tl.load(BIAS + N + b_cols).to(tl.float32)[None, :]
            # the projection's output is rounded to fp16 before GEGLU in the host's path: the same here
            out = out.to(tl.float16).to(tl.float32)
            gate = gate.to(tl.float16).to(tl.float32)
            out = out * (0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)))    # exact GELU
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(C + rows[:, None].to(tl.int64) * N + cols[None, :], out.to(C.dtype.element_ty), mask=mask)


class Config(tuple):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of one launch."""
    __slots__ = ()

    def __new__(cls, block_m, block_n, block_k, warps, stages):
        return super().__new__(cls, (block_m, block_n, block_k, warps, stages))


def config_for(M, N, K, geglu):
    """The launch shape of one GEMM ([M, K] x [K, N] output columns N; with geglu two accumulators per tile).
    Swept by bench/bench_fp8_gemm.py on the H200 over SD1.5 and SDXL's transformer Linears (bench/RESULTS.md,
    "The measurements behind the kernels' constants"); BLOCK_K divides K wherever SD's widths allow it."""
    block_k = 128 if K % 128 == 0 else 64
    if geglu:
        wide = M >= 2048 and N >= 5120
        return Config(128, 128, block_k, 8, 3) if wide else Config(128, 64, block_k, 4, 3)
    if M * N >= 4 * 2 ** 20:
        return Config(128, 128, block_k, 8, 3)
    return Config(64, 128, block_k, 4, 3)


def _launch(xq, xs, wq, ws, bias, geglu, config):
    M, K = xq.shape
    n_all = wq.shape[0]
    N = n_all // 2 if geglu else n_all
    out = torch.empty((M, N), device=xq.device, dtype=torch.float16)
    bm, bn, bk, warps, stages = config or config_for(M, N, K, geglu)
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    launch(_fp8_gemm_kernel, grid, xq, xs, wq, ws, bias if bias is not None else ws, out, M, N, K, xq.stride(0),
           HAS_BIAS=bias is not None, GEGLU=bool(geglu), EVEN_K=K % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
           GROUP=GROUP_M, num_warps=warps, num_stages=stages)
    return out


def eligible(xq, xs, wq, ws, bias, geglu):
    """(True, "") when the Triton kernel takes these operands, else (False, why)."""
    if FP8 is None:
        return False, "no float8_e4m3fn in this torch"
    why = device_dtype_ineligible(xq, (FP8,))
    if why:
        return False, why
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        return False, "shapes %s x %s do not multiply" % (tuple(xq.shape), tuple(wq.shape))
    M, K = xq.shape
    n_all = wq.shape[0]
    if M == 0 or K % 16 or n_all % (32 if geglu else 16):
        return False, "sizes M=%d K=%d N=%d (K, N multiples of 16 needed)" % (M, K, n_all)
    if wq.dtype != FP8 or not wq.is_contiguous() or xq.stride(1) != 1:
        return False, "weight not contiguous float8_e4m3fn, or activations not unit-stride along K"
    if xs.dtype != torch.float32 or xs.numel() != M or ws.dtype != torch.float32 or ws.numel() != n_all:
        return False, "scales not fp32 [M, 1] and [1, N]"
    if not (xs.is_contiguous() and ws.is_contiguous()):
        return False, "scales not contiguous"
    if bias is not None and (bias.dtype != torch.float16 or bias.shape != (n_all,) or bias.stride() != (1,)):
        return False, "bias not a contiguous fp16 [N] tensor"
    if any(t.device != xq.device for t in (xs, wq, ws) + ((bias,) if bias is not None else ())):
        return False, "operands on different devices"
    if M * max(K, n_all) >= 2 ** 31:
        return False, "too large for int32 offsets"
    why = forward_only_ineligible(xq, wq)
    return (False, why) if why else (True, "")


@fused_op(eligible=eligible, launch=_launch)
def fp8_gemm(xq, xs, wq, ws, bias=None, geglu=False, config=None):
    """fp16 `(xq * xs) @ (wq * ws.T).T + bias`, or its GEGLU (see the module's docstring); `config` (a Config)
    overrides the launch shape, for the benchmark.

    Triton when `eligible`, else the reference; `fp8_gemm.last_call` says which ran.
    """
    return (xq, xs, wq, ws, bias, geglu, config)


@fp8_gemm.fallback
def fp8_gemm_reference(xq, xs, wq, ws, bias=None, geglu=False):
    """Plain torch, in fp32 from the dequantized operands, rounded to fp16 where the kernel rounds."""
    out = (xq.float() * xs.reshape(-1, 1)) @ (wq.float() * ws.reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    out = out.to(torch.float16)
    if not geglu:
        return out
    value, gate = out.float().chunk(2, dim=-1)
    return (value * F.gelu(gate)).to(torch.float16)
