"""GroupNorm (+ optional SiLU) fused, forward only: the `norm -> SiLU` pair at the head of every SD ResBlock.

Why a split design: SD uses 32 groups, so batch 2 gives only 64 groups, and one program per group would
leave most of an H200's 132 SMs idle. Instead three small launches, each with many programs:

  1. `_gn_stats_kernel`    grid (spatial tiles / CHUNK_ITERS, channel tiles, N): per-channel partial
                           mean and M2 (sum of squared deviations) over a spatial chunk, in fp32,
                           from sums shifted by a data sample (no E[x^2] - E[x]^2 cancellation).
  2. `_gn_finalize_kernel` grid (N * G,): merges a group's partials (Chan et al.) and writes
                           per-(n, c) `mean`, `scale` = rstd * weight, `shift` = bias.
  3. `_gn_apply_kernel`    grid (spatial tiles, channel tiles, N): y = (x - mean) * scale + shift,
                           SiLU, store.

x is addressed as (N, C, HW) through strides, so NCHW (stride_c = HW, stride_s = 1) and channels_last
(stride_c = 1, stride_s = C) share the kernels; only the tile shape changes so that the tile's long
side runs along the contiguous axis. Output keeps x's strides (`empty_like`). No host sync, and all
allocations depend on shapes only, so the op can be captured in a CUDA graph.
"""
import torch
import torch.nn.functional as F

from ._triton import NotWarmedUp, cdiv, get_triton, init_record, launch, next_pow2, num_warps_for, record, triton_runnable

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_CHUNKS = 64        # spatial chunks per batch item: bounds what one finalize program merges
_MAX_GROUP_CHANNELS = 4096
_SMS = 132              # H200; only used to shrink tiles for small tensors (more, smaller programs)
_TILE = 2048            # elements per program tile (measured on H200: 2048 beats 4096 and 8192 on channels_last)

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _gn_stats_kernel(
        X,                              # input, read as (N, C, HW) through the three strides
        WS,                             # fp32 workspace; this kernel writes its first 2 * N * NSC * C:
                                        #   PMEAN, PM2 [N, NSC, C]: per (batch, chunk, channel) mean and M2
        N, C, HW,                       # batch, channels, spatial positions (H * W, or L)
        stride_n, stride_c, stride_s,   # element strides of x (NCHW: C*HW, HW, 1; channels_last: HW*C, 1, C)
        NSC, CHUNK_ITERS,               # spatial chunks per batch item; BLOCK_S tiles in each chunk
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid_sc = tl.program_id(0)
        pid_c = tl.program_id(1)
        n = tl.program_id(2)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = offs_c < C
        ptrs = X + n * stride_n + offs_c[None, :] * stride_c
        s_start = pid_sc * CHUNK_ITERS * BLOCK_S
        # Shifted sums: accumulate d = x - pivot and d^2, pivot = the chunk's first value per channel.
        # The pivot is a sample of the data, so sum(d^2) - sum(d)^2 / n does not cancel even when
        # |mean| >> std. Accumulating elementwise and reducing once at the end keeps the loop free of
        # cross-warp reductions (which made a per-tile Welford merge latency bound on channels_last).
        pivot = tl.load(X + n * stride_n + offs_c * stride_c + s_start * stride_s, mask=cmask,
                        other=0.0).to(tl.float32)
        acc_s = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        acc_q = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        for it in range(0, CHUNK_ITERS):
            offs_s = s_start + it * BLOCK_S + tl.arange(0, BLOCK_S)
            mask = (offs_s < HW)[:, None] & cmask[None, :]
            # evict_last: the apply kernel reads x again right after; keep it in L2 (60 MB on H200)
            x = tl.load(ptrs + offs_s[:, None] * stride_s, mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            d = tl.where(mask, x - pivot[None, :], 0.0)
            acc_s += d
            acc_q += d * d
        cnt = tl.minimum(HW - s_start, CHUNK_ITERS * BLOCK_S).to(tl.float32)
        sum_d = tl.sum(acc_s, axis=0)
        mean_d = sum_d / cnt
        m2 = tl.maximum(tl.sum(acc_q, axis=0) - sum_d * mean_d, 0.0)
        out = (n * NSC + pid_sc) * C + offs_c
        tl.store(WS + out, pivot + mean_d, mask=cmask)
        tl.store(WS + N * NSC * C + out, m2, mask=cmask)

    @triton.jit
    def _gn_finalize_kernel(
        WS,                         # fp32 workspace: reads PMEAN, PM2 [N, NSC, C] (from _gn_stats_kernel),
                                    #   then writes MEAN, SCALE, SHIFT [N, C]: y = (x - mean) * scale + shift
        W, B,                       # affine weight / bias [C], any float dtype (ignored unless HAS_W / HAS_B)
        ADD,                        # fp32 [N, C] added to x before the norm (ignored unless HAS_ADD)
        N, C, HW, G, CG,            # batch, channels, spatial size, groups, channels per group
        NSC, CHUNK_S,               # chunks per batch item, spatial positions per chunk (last may be short)
        eps,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_ADD: tl.constexpr,
        BLOCK_SC: tl.constexpr, BLOCK_CG: tl.constexpr,
    ):
        # GroupNorm(x + add) with add constant per (n, c): each channel's chunk means shift by add[n, c],
        # its M2 does not; and (x + add - mean) = (x - (mean - add)), so the apply kernel is unchanged
        # when MEAN holds mean - add. The add costs nothing on the big tensor.
        pid = tl.program_id(0)
        n = pid // G
        g = pid % G
        PMEAN = WS
        PM2 = WS + N * NSC * C
        MEAN = WS + 2 * N * NSC * C
        offs_cg = tl.arange(0, BLOCK_CG)
        cmask = offs_cg < CG
        c = g * CG + offs_cg
        base = n * NSC * C + c
        count = CG * HW * 1.0
        shift_c = tl.zeros([BLOCK_CG], dtype=tl.float32)
        if HAS_ADD:
            shift_c = tl.load(ADD + n * C + c, mask=cmask, other=0.0)
        # pass 1: group mean = chunk means weighted by chunk sizes, summed relative to the first one
        pivot = tl.load(PMEAN + n * NSC * C + g * CG)
        if HAS_ADD:
            pivot += tl.load(ADD + n * C + g * CG)
        acc = tl.zeros([BLOCK_SC, BLOCK_CG], dtype=tl.float32)
        for sc0 in range(0, NSC, BLOCK_SC):
            sc = sc0 + tl.arange(0, BLOCK_SC)
            m = (sc < NSC)[:, None] & cmask[None, :]
            w_sc = tl.minimum(tl.maximum(HW - sc * CHUNK_S, 0), CHUNK_S).to(tl.float32)
            pm = tl.load(PMEAN + base[None, :] + sc[:, None] * C, mask=m, other=0.0) + shift_c[None, :]
            acc += tl.where(m, pm - pivot, 0.0) * w_sc[:, None]
        mean = pivot + tl.sum(tl.sum(acc, axis=1), axis=0) / count
        # pass 2: group M2 = sum of chunk M2s + chunk sizes * (chunk mean - group mean)^2
        acc = tl.zeros([BLOCK_SC, BLOCK_CG], dtype=tl.float32)
        for sc0 in range(0, NSC, BLOCK_SC):
            sc = sc0 + tl.arange(0, BLOCK_SC)
            m = (sc < NSC)[:, None] & cmask[None, :]
            w_sc = tl.minimum(tl.maximum(HW - sc * CHUNK_S, 0), CHUNK_S).to(tl.float32)
            pm = tl.load(PMEAN + base[None, :] + sc[:, None] * C, mask=m, other=0.0) + shift_c[None, :]
            pm2 = tl.load(PM2 + base[None, :] + sc[:, None] * C, mask=m, other=0.0)
            d = pm - mean
            acc += tl.where(m, pm2 + w_sc[:, None] * d * d, 0.0)
        var = tl.sum(tl.sum(acc, axis=1), axis=0) / count
        rstd = 1.0 / tl.sqrt(var + eps)
        scale = tl.zeros([BLOCK_CG], dtype=tl.float32) + rstd
        if HAS_W:
            scale = scale * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
        shift = tl.zeros([BLOCK_CG], dtype=tl.float32)
        if HAS_B:
            shift = tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)
        tl.store(MEAN + n * C + c, mean - shift_c, mask=cmask)
        tl.store(MEAN + N * C + n * C + c, scale, mask=cmask)
        tl.store(MEAN + 2 * N * C + n * C + c, shift, mask=cmask)

    @triton.jit
    def _gn_apply_kernel(
        X, Y,                           # input / output with identical strides
        MEAN,                           # fp32 MEAN, SCALE, SHIFT [N, C] back to back (finalize kernel)
        N, C, HW,
        stride_n, stride_c, stride_s,   # as in _gn_stats_kernel
        APPLY_SILU: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid_s = tl.program_id(0)
        pid_c = tl.program_id(1)
        n = tl.program_id(2)
        offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = offs_c < C
        mask = (offs_s < HW)[:, None] & cmask[None, :]
        offs = n * stride_n + offs_s[:, None] * stride_s + offs_c[None, :] * stride_c
        x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        mu = tl.load(MEAN + n * C + offs_c, mask=cmask, other=0.0)
        a = tl.load(MEAN + N * C + n * C + offs_c, mask=cmask, other=0.0)
        b = tl.load(MEAN + 2 * N * C + n * C + offs_c, mask=cmask, other=0.0)
        # (x - mean) * a rather than x * a - mean * a: no cancellation when |mean| >> std
        y = (x - mu[None, :]) * a[None, :] + b[None, :]
        if APPLY_SILU:
            y = y * tl.sigmoid(y)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _is_channels_last(x):
    # A tensor can be both (C == 1 or H * W == 1); NCHW addressing is then right for it too.
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _config(N, C, HW, channels_last):
    """Tile shape (BLOCK_S spatial x BLOCK_C channels), long along the contiguous axis, and chunking."""
    # _TILE elements per program for big tensors; smaller tiles for small ones so the grid still
    # covers the SMs a few times over (these shapes are latency bound anyway).
    tile = max(1024, min(_TILE, next_pow2(N * C * HW // (4 * _SMS))))
    if channels_last:
        # rows of C contiguous channels: 64-128 channels per tile = 128-512 B runs per row
        block_c = 128 if C % 128 == 0 else 64 if C % 64 == 0 else max(2, min(128, next_pow2(C)))
        block_s = max(2, min(tile // block_c, next_pow2(HW)))
    else:
        block_s = max(2, min(next_pow2(HW), 1024, tile))
        block_c = max(2, min(tile // block_s, next_pow2(C)))
    s_tiles = cdiv(HW, block_s)
    chunk_iters = cdiv(s_tiles, _MAX_CHUNKS)
    nsc = cdiv(s_tiles, chunk_iters)
    return block_s, block_c, s_tiles, chunk_iters, nsc


def _launch(x, num_groups, weight, bias, eps, activation, add=None):
    N, C = x.shape[0], x.shape[1]
    HW = x.numel() // (N * C)
    cl = _is_channels_last(x)
    strides = (HW * C, 1, C) if cl else (C * HW, HW, 1)
    block_s, block_c, s_tiles, chunk_iters, nsc = _config(N, C, HW, cl)
    c_tiles = cdiv(C, block_c)
    warps = num_warps_for(block_s * block_c)

    # one fp32 workspace (fewer host-side allocations per call): PMEAN, PM2 [N, nsc, C], then
    # MEAN, SCALE, SHIFT [N, C]; each kernel derives the parts' offsets from N, nsc and C
    ws = torch.empty(N * C * (2 * nsc + 3), device=x.device, dtype=torch.float32)
    y = torch.empty_like(x)  # preserve_format: same strides as x, so channels_last stays channels_last

    launch(_gn_stats_kernel, (nsc, c_tiles, N),
        x, ws, N, C, HW, *strides, nsc, chunk_iters,
        BLOCK_S=block_s, BLOCK_C=block_c, num_warps=warps)

    cg = C // num_groups
    block_cg = max(2, next_pow2(cg))
    block_sc = max(2, min(next_pow2(nsc), 4096 // block_cg))
    launch(_gn_finalize_kernel, (N * num_groups,),
        ws, weight if weight is not None else ws, bias if bias is not None else ws,
        add if add is not None else ws,
        N, C, HW, num_groups, cg, nsc, chunk_iters * block_s, float(eps),
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_ADD=add is not None,
        BLOCK_SC=block_sc, BLOCK_CG=block_cg, num_warps=4)

    launch(_gn_apply_kernel, (s_tiles, c_tiles, N),
        x, y, ws[2 * N * nsc * C:], N, C, HW, *strides,
        APPLY_SILU=activation == "silu", BLOCK_S=block_s, BLOCK_C=block_c, num_warps=warps)
    return y


def eligible(x, num_groups, weight=None, bias=None):
    """(True, "") when the Triton kernels handle these arguments, else (False, why)."""
    ok, why = triton_runnable(x)
    if not ok:
        return False, why
    if x.dtype not in _DTYPES:
        return False, f"dtype {x.dtype}"
    if x.dim() not in (3, 4):
        return False, f"{x.dim()}-D input"
    if not (x.is_contiguous() or _is_channels_last(x)):
        return False, "layout neither contiguous nor channels_last"
    if x.numel() == 0:
        return False, "empty input"
    if x.numel() >= 2**31:
        return False, "too large for int32 offsets"
    if x.shape[0] > 65535:
        return False, "batch > 65535 (grid limit)"
    C = x.shape[1]
    if num_groups <= 0 or C % num_groups:
        return False, f"C={C} not divisible by num_groups={num_groups}"
    if C // num_groups > _MAX_GROUP_CHANNELS:
        return False, f"{C // num_groups} channels per group"
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.device != x.device or not p.is_floating_point() or p.shape != (C,) or p.stride() != (1,):
            return False, f"{name} not a contiguous float [C] tensor on x's device"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return False, "autograd needed (kernel is forward only)"
    return True, ""


def _add_operand(x, add):
    """`add` as the kernel reads it: fp32, contiguous [N, C]; None if it is not one per (n, c)."""
    if add.dim() == 1:
        add = add.unsqueeze(0).expand(x.shape[0], -1)
    if add.shape != x.shape[:2] or add.device != x.device or not add.is_floating_point():
        return None
    return add.to(torch.float32).contiguous()


@init_record
def group_norm_silu(x, num_groups, weight=None, bias=None, eps=1e-5, activation="silu", add=None):
    """F.silu(F.group_norm(x + add, num_groups, weight, bias, eps)) (activation=None: the norm alone).

    `add`: optional [N, C] (or [C]) term added to x per sample and channel before the norm (a ResBlock's
    conv bias plus its timestep embedding): folded into the statistics, so it costs no pass over x.
    Runs the fused Triton kernels when `eligible`, else the reference; `group_norm_silu.last_path`
    ("triton" / "reference"), `.last_reason` and `.calls` say which ran. Output has x's dtype and
    memory format.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    ok, why = eligible(x, num_groups, weight, bias)
    add_k = None
    if ok and add is not None:
        add_k = _add_operand(x, add)
        if add_k is None:
            ok, why = False, "add is not one value per (sample, channel) on x's device"
    if ok:
        try:
            y = _launch(x, num_groups, weight, bias, eps, activation, add_k)
            record(group_norm_silu, "triton")
            return y
        except NotWarmedUp:
            why = "graph capture before any eager call of this shape"
    record(group_norm_silu, "reference", why)
    y = group_norm_silu_reference(x, num_groups, weight, bias, eps, activation, add)
    if _is_channels_last(x) and not y.is_contiguous(memory_format=torch.channels_last):
        y = y.contiguous(memory_format=torch.channels_last)
    return y


def group_norm_silu_reference(x, num_groups, weight=None, bias=None, eps=1e-5, activation="silu", add=None):
    """Plain torch, in x's dtype: weight and bias are cast to it first, as ComfyUI's ops do; `add`
    ([N, C] or [C]) is added to x first, in x's dtype, as the ResBlock it stands for does."""
    if add is not None:
        add = add.to(x.dtype)
        add = add[None] if add.dim() == 1 else add
        if add.dim() == 2:   # [N, C]: one value per sample and channel
            add = add.reshape(add.shape + (1,) * (x.dim() - 2))
        x = x + add
    if x.is_floating_point():
        weight = weight.to(x.dtype) if weight is not None else None
        bias = bias.to(x.dtype) if bias is not None else None
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if activation == "silu" else y
