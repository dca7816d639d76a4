"""GEGLU's projection and activation in one kernel: `a, gate = (x @ W.T + b).chunk(2, -1); a * gelu(gate)`.

The feed-forward of every SD transformer block starts with a Linear of width 2D (D = 4 x channels) whose
output GEGLU reads straight back: cuBLAS writes the [M, 2D] product, then kernels/geglu.py reads it and
writes [M, D]. At SDXL's 1024² (CFG batch 2) that round trip is 63-126 MB per block, 70 blocks a step. Here
each program computes a [BLOCK_M, BLOCK_N] tile of both halves' products (two fp32 accumulators, the weight
rows n and D + n), adds the bias and applies a * gelu(gate) in fp32 before the one store of [M, D].

Numerics: the product is not rounded to the input dtype before the GELU (stock rounds it, then computes
gelu and the product in its dtype): the result differs from stock's by fp16 rounding, as any other GEMM
tiling would.

Tiles: `_config` picks a tiling per problem size (measured on the H200 by bench/bench_linear_geglu.py;
`SDACCEL_LINEAR_GEGLU_CONFIG=BM,BN,BK,warps,stages` overrides it). The hosts use the kernel only where that
bench measured it faster than cuBLAS + the GEGLU kernel (engine/fused_modules.FusedGEGLU, `fast_here`).
"""
import os

import torch
import torch.nn.functional as F

from ._triton import NotWarmedUp, cdiv, get_triton, init_record, launch, record, triton_runnable

_DTYPES = (torch.float16, torch.bfloat16)

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _linear_geglu_kernel(
        X,                  # [M, K] row-major contiguous
        W,                  # [2D, K] row-major contiguous (a Linear's weight): rows [0, D) = a, [D, 2D) = gate
        B,                  # [2D] bias (ignored unless HAS_BIAS)
        OUT,                # [M, D] contiguous
        M, K, D,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # grouped order: GROUP_M row tiles share each column tile, so its weights stay in L2
        pid = tl.program_id(0)
        n_m = tl.cdiv(M, BLOCK_M)
        n_n = tl.cdiv(D, BLOCK_N)
        in_group = GROUP_M * n_n
        first_m = (pid // in_group) * GROUP_M
        size_m = min(n_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % size_m
        pid_n = (pid % in_group) // size_m

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < D
        x_ptrs = X + rows[:, None] * K + ks[None, :]
        wa_ptrs = W + cols[None, :] * K + ks[:, None]            # [BLOCK_K, BLOCK_N] view of W_a^T
        wg_ptrs = W + (cols[None, :] + D) * K + ks[:, None]
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wa = tl.load(wa_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_a = tl.dot(x, wa, acc_a)
            acc_g = tl.dot(x, wg, acc_g)
            x_ptrs += BLOCK_K
            wa_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
        if HAS_BIAS:
            acc_a += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.load(B + D + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = acc_a * (0.5 * acc_g * (1.0 + tl.math.erf(acc_g * 0.7071067811865476)))   # exact GELU
        tl.store(OUT + rows[:, None] * D + cols[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _override():
    v = os.environ.get("SDACCEL_LINEAR_GEGLU_CONFIG")
    return tuple(int(p) for p in v.split(",")) if v else None


def _config(M, K, D):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    o = _override()
    if o is not None:
        return o
    if M >= 4096:
        return 128, 128, 64, 8, 3
    return 64, 128, 64, 4, 4


def _launch(x2, w, b, D):
    M, K = x2.shape
    out = torch.empty((M, D), device=x2.device, dtype=x2.dtype)
    bm, bn, bk, warps, stages = _config(M, K, D)
    launch(_linear_geglu_kernel, (cdiv(M, bm) * cdiv(D, bn),),
           x2, w, b if b is not None else w, out, M, K, D, HAS_BIAS=b is not None,
           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def eligible(x, w, b):
    """(True, "") when the Triton kernel handles x @ w.T + b here, else (False, why)."""
    ok, why = triton_runnable(x)
    if not ok:
        return False, why
    if x.dtype not in _DTYPES:
        return False, f"dtype {x.dtype}"
    if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return False, "weight dtype differs from the input's"
    if w.device != x.device or (b is not None and b.device != x.device):
        return False, "weight on another device"
    if w.dim() != 2 or w.shape[0] % 2 or x.shape[-1] != w.shape[1] or not w.is_contiguous():
        return False, "weight not a contiguous [2D, K] matrix for this input"
    if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0] or not b.is_contiguous()):
        return False, "bias shape"
    if x.numel() == 0 or not x.is_contiguous():
        return False, "empty or non-contiguous input"
    if x.shape[-1] % 8 or (w.shape[0] // 2) % 8:
        return False, "widths not multiples of 8"
    M = x.numel() // x.shape[-1]
    if max(x.numel(), w.numel(), M * w.shape[0]) >= 2**31:
        return False, "too large for int32 offsets"
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False, "autograd needed (kernel is forward only)"
    return True, ""


@init_record
def linear_geglu(x, w, b=None):
    """a * gelu(gate) of `(x @ w.T + b).chunk(2, -1)`, (..., D) in x's dtype.

    Triton when `eligible`, else the reference; `linear_geglu.last_path` / `.last_reason` / `.calls` say which.
    """
    ok, why = eligible(x, w, b)
    if ok:
        try:
            out = _launch(x.reshape(-1, x.shape[-1]), w, b, w.shape[0] // 2)
            record(linear_geglu, "triton")
            return out.view(x.shape[:-1] + (w.shape[0] // 2,))
        except NotWarmedUp as e:
            why = e.reason
    record(linear_geglu, "reference", why)
    return linear_geglu_reference(x, w, b)


def linear_geglu_reference(x, w, b=None):
    """Plain torch, as ComfyUI's GEGLU: the projection in x's dtype, then a * gelu(gate)."""
    a, gate = F.linear(x, w, b).chunk(2, dim=-1)
    return a * F.gelu(gate)
