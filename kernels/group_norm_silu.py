"""GroupNorm (+ optional SiLU) fused, forward only: the `norm -> SiLU` pair at the head of every SD ResBlock.

Two paths, at most two launches per call (statistics in fp32 either way):

* one program per (sample, group), `_gn_group_kernel`, grid (N * G,), one launch: when a whole group
  fits in one register tile (`_ONE_TILE_MAX` lanes; at SD1.5 512²: the 8² level, 16² up to 640
  channels), the program loads it once, takes the mean and the variance from the registers
  (two-pass, exact), normalizes and stores. Few programs (N * G), but each is a single round trip to
  memory, and these tensors are small.
* split, two launches with many programs each, for bigger groups (a batch of 2 has only 64 groups, and
  one program per group would stream a large group alone while most SMs idle):
  1. `_gn_stats_kernel` grid (spatial chunks, channel tiles, N): per-channel mean and M2 (sum of
     squared deviations) over a spatial chunk from sums shifted by a data sample (no E[x^2] - E[x]^2
     cancellation), merged (Chan et al.) into one partial per (chunk, group) of the tile;
  2. `_gn_apply_kernel` grid (spatial tile runs, channel tiles, N): merges its groups' partials into
     mean and rstd itself (no separate "finalize" launch between the two), then y = (x - mean) * scale +
     shift, SiLU, store, over a run of spatial tiles.
  Channel tiles never straddle a group: a tile holds K whole groups (BLOCK_C >= K * CG) or one of the
  J parts of a group too wide for a tile, so every partial belongs to one group.

x is addressed as (N, C, HW) through strides, so NCHW (stride_c = HW, stride_s = 1) and channels_last
(stride_c = 1, stride_s = C) share the kernels; only the tile shape changes so that the tile's long
side runs along the contiguous axis. Output keeps x's strides (`empty_like`). `add` ([N, C], a
ResBlock's conv bias + timestep embedding) shifts the per-channel means before they are merged, and the
normalization subtracts mean - add: it costs no pass over x. No host sync, and all allocations depend
on shapes only, so the op can be captured in a CUDA graph.

Which path, and the split path's tiling, are plain arithmetic in _group_norm_tiling.py, whose constants
come from bench/tune_group_norm.py; bench/bench_group_norm_silu.py prints which path each shape takes and
its time against torch's.
"""
import torch
import torch.nn.functional as F

from . import _group_norm_tiling as tiling
from ._compile_ahead import CompilingAhead
from ._device import sm_count
from ._dispatch import fused_op
from ._group_norm_tiling import one_program_per_group
from ._launch import launch
from ._tiling import cdiv, next_pow2, num_warps_for
from ._triton import (activation_ineligible, forward_only_ineligible, get_triton, is_channels_last,
                      vectors_ineligible)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_GROUP_CHANNELS = 4096

_tt = get_triton()
if _tt is not None:
    triton, tl = _tt

    @triton.jit
    def _gn_group_kernel(
        X, Y,                           # input / output, identical strides, read as (N, C, HW)
        W, B,                           # affine weight / bias [C], any float dtype (ignored unless HAS_W / HAS_B)
        ADD,                            # fp32 [N, C] added to x before the norm (ignored unless HAS_ADD)
        ADD_STRIDE,                     # ADD's row stride in elements (its channels are contiguous)
        C, HW, G, CG,                   # channels, spatial positions, groups, channels per group
        stride_n, stride_c, stride_s,   # element strides of x (NCHW: C*HW, HW, 1; channels_last: HW*C, 1, C)
        eps,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_ADD: tl.constexpr, APPLY_SILU: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_CG: tl.constexpr,   # >= HW and >= CG: the whole group in one tile
    ):
        pid = tl.program_id(0)
        n = pid // G
        g = pid % G
        offs_s = tl.arange(0, BLOCK_S)
        offs_cg = tl.arange(0, BLOCK_CG)
        cmask = offs_cg < CG
        c = g * CG + offs_cg
        mask = (offs_s < HW)[:, None] & cmask[None, :]
        offs = n * stride_n + offs_s[:, None] * stride_s + c[None, :] * stride_c
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_ADD:
            x += tl.load(ADD + n * ADD_STRIDE + c, mask=cmask, other=0.0)[None, :]
        count = CG * HW * 1.0
        mean = tl.sum(tl.sum(tl.where(mask, x, 0.0), axis=1), axis=0) / count
        d = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(d * d, axis=1), axis=0) / count + eps)
        scale = tl.zeros([BLOCK_CG], dtype=tl.float32) + rstd
        if HAS_W:
            scale = scale * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
        y = d * scale[None, :]
        if HAS_B:
            y += tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if APPLY_SILU:
            y = y * tl.sigmoid(y)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _tile_channels(pid_t, G, CG, K, J, BLOCK_C: tl.constexpr):
        # Channel tile pid_t: K whole groups from g0 (J == 1), or part j of group g0 (K == 1, J parts).
        g0 = (pid_t // J) * K
        c_start = g0 * CG + (pid_t % J) * BLOCK_C
        c_end = tl.minimum(c_start + BLOCK_C, tl.minimum(g0 + K, G) * CG)
        offs_c = c_start + tl.arange(0, BLOCK_C)
        return g0, offs_c, offs_c < c_end, (offs_c - g0 * CG) // CG   # ..., each channel's group slot

    @triton.jit
    def _partials(p0, P, J, HW, CHUNK_S, CG, n, NSC, C_TILES, t0, kmask,
                  BLOCK_C: tl.constexpr, KB: tl.constexpr, BLOCK_P: tl.constexpr):
        # Partials p0..p0+BLOCK_P of a tile's groups: partial p = (chunk p // J, group part p % J). Returns
        # each one's element count, the [BLOCK_P, KB] mask and its row in the (mean, M2) workspaces.
        p = p0 + tl.arange(0, BLOCK_P)
        sc = p // J
        jj = p % J
        w_p = (tl.minimum(tl.maximum(HW - sc * CHUNK_S, 0), CHUNK_S)
               * tl.minimum(BLOCK_C, CG - jj * BLOCK_C)).to(tl.float32)
        m = (p < P)[:, None] & kmask[None, :]
        addr = ((n * NSC + sc) * C_TILES + t0 + jj) * KB
        return w_p, m, addr

    @triton.jit
    def _gn_stats_kernel(
        X,                              # input, read as (N, C, HW) through the three strides
        WS,                             # fp32 workspace: writes PMEAN, PM2 [N, NSC, C_TILES, KB]: per
                                        #   (batch, chunk, channel tile, group slot) mean and M2
        ADD,                            # fp32 [N, C] added to x before the norm (ignored unless HAS_ADD)
        ADD_STRIDE,                     # ADD's row stride in elements
        N, C, HW, G, CG,                # batch, channels, spatial positions, groups, channels per group
        stride_n, stride_c, stride_s,   # as in _gn_group_kernel
        NSC, CHUNK_ITERS,               # spatial chunks per batch item; BLOCK_S tiles in each chunk
        C_TILES, K, J,                  # channel tiles; whole groups per tile; tiles per group (K == 1)
        HAS_ADD: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, KB: tl.constexpr,   # KB: K's next power of two
    ):
        pid_sc = tl.program_id(0)
        pid_t = tl.program_id(1)
        n = tl.program_id(2)
        g0, offs_c, cmask, slot = _tile_channels(pid_t, G, CG, K, J, BLOCK_C)
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
            # evict_last: the apply kernel reads x again right after; keep it in L2
            x = tl.load(ptrs + offs_s[:, None] * stride_s, mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            d = tl.where(mask, x - pivot[None, :], 0.0)
            acc_s += d
            acc_q += d * d
        cnt = tl.minimum(HW - s_start, CHUNK_ITERS * BLOCK_S).to(tl.float32)
        sum_d = tl.sum(acc_s, axis=0)
        mean_c = pivot + sum_d / cnt
        m2_c = tl.maximum(tl.sum(acc_q, axis=0) - sum_d * (sum_d / cnt), 0.0)
        if HAS_ADD:   # GroupNorm(x + add), add constant per (n, c): the channel's mean shifts, M2 does not
            mean_c += tl.load(ADD + n * ADD_STRIDE + offs_c, mask=cmask, other=0.0)
        # per-channel (mean, M2) -> one per group slot of the tile (Chan et al.: equal counts per channel)
        onehot = ((slot[:, None] == tl.arange(0, KB)[None, :]) & cmask[:, None]).to(tl.float32)
        chans = tl.sum(onehot, axis=0)
        s_mean = tl.sum(onehot * mean_c[:, None], axis=0) / tl.maximum(chans, 1.0)
        dev = tl.where(cmask, mean_c - tl.sum(onehot * s_mean[None, :], axis=1), 0.0)
        s_m2 = tl.sum(onehot * (m2_c + cnt * dev * dev)[:, None], axis=0)
        out = ((n * NSC + pid_sc) * C_TILES + pid_t) * KB + tl.arange(0, KB)
        tl.store(WS + out, s_mean)
        tl.store(WS + N * NSC * C_TILES * KB + out, s_m2)

    @triton.jit
    def _merged_stats(WS, N, NSC, C_TILES, K, J, G, CG, HW, CHUNK_S, n, pid_t, g0, eps,
                      BLOCK_C: tl.constexpr, KB: tl.constexpr, BLOCK_P: tl.constexpr):
        # (mean, rstd) of each group slot of channel tile pid_t, merged from the partials _gn_stats_kernel wrote
        # to WS (_partials); a group has CG * HW elements in all.
        PMEAN = WS
        PM2 = WS + N * NSC * C_TILES * KB
        kk = tl.arange(0, KB)
        kmask = (kk < K) & (g0 + kk < G)
        P = NSC * J
        t0 = (pid_t // J) * J
        count = CG * HW * 1.0
        row0 = (n * NSC * C_TILES + t0) * KB
        pivot = tl.load(PMEAN + row0 + kk)
        acc = tl.zeros([BLOCK_P, KB], dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            w_p, m, addr = _partials(p0, P, J, HW, CHUNK_S, CG, n, NSC, C_TILES, t0, kmask, BLOCK_C, KB, BLOCK_P)
            pm = tl.load(PMEAN + addr[:, None] + kk[None, :], mask=m, other=0.0)
            acc += tl.where(m, pm - pivot[None, :], 0.0) * w_p[:, None]
        mean = pivot + tl.sum(acc, axis=0) / count
        acc = tl.zeros([BLOCK_P, KB], dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            w_p, m, addr = _partials(p0, P, J, HW, CHUNK_S, CG, n, NSC, C_TILES, t0, kmask, BLOCK_C, KB, BLOCK_P)
            pm = tl.load(PMEAN + addr[:, None] + kk[None, :], mask=m, other=0.0)
            pm2 = tl.load(PM2 + addr[:, None] + kk[None, :], mask=m, other=0.0)
            dm = pm - mean[None, :]
            acc += tl.where(m, pm2 + w_p[:, None] * dm * dm, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / count + eps)
        return mean, rstd

    @triton.jit
    def _gn_apply_kernel(
        X, Y,                           # input / output with identical strides
        WS,                             # fp32 PMEAN, PM2 [N, NSC, C_TILES, KB] (from _gn_stats_kernel)
        W, B,                           # affine weight / bias [C], any float dtype (ignored unless HAS_W / HAS_B)
        ADD,                            # fp32 [N, C] (ignored unless HAS_ADD)
        ADD_STRIDE,                     # ADD's row stride in elements
        N, C, HW, G, CG,
        stride_n, stride_c, stride_s,   # as in _gn_group_kernel
        NSC, CHUNK_S,                   # chunks per batch item, spatial positions per chunk (last may be short)
        C_TILES, K, J,                  # as in _gn_stats_kernel
        APPLY_ITERS,                    # spatial tiles per program (amortize the merge below)
        eps,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_ADD: tl.constexpr, APPLY_SILU: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, KB: tl.constexpr,
        BLOCK_P: tl.constexpr,          # partials (chunk x group part) merged per step
    ):
        pid_s = tl.program_id(0)
        pid_t = tl.program_id(1)
        n = tl.program_id(2)
        g0, offs_c, cmask, slot = _tile_channels(pid_t, G, CG, K, J, BLOCK_C)
        mean, rstd = _merged_stats(WS, N, NSC, C_TILES, K, J, G, CG, HW, CHUNK_S, n, pid_t, g0, eps,
                                   BLOCK_C, KB, BLOCK_P)
        # per group slot -> per channel of the tile
        kk = tl.arange(0, KB)
        onehot = ((slot[:, None] == kk[None, :]) & cmask[:, None]).to(tl.float32)
        mu = tl.sum(onehot * mean[None, :], axis=1)
        scale = tl.sum(onehot * rstd[None, :], axis=1)
        if HAS_ADD:   # (x + add - mean) = (x - (mean - add))
            mu -= tl.load(ADD + n * ADD_STRIDE + offs_c, mask=cmask, other=0.0)
        if HAS_W:
            scale = scale * tl.load(W + offs_c, mask=cmask, other=0.0).to(tl.float32)
        shift = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_B:
            shift = tl.load(B + offs_c, mask=cmask, other=0.0).to(tl.float32)
        for it in range(0, APPLY_ITERS):
            offs_s = (pid_s * APPLY_ITERS + it) * BLOCK_S + tl.arange(0, BLOCK_S)
            mask = (offs_s < HW)[:, None] & cmask[None, :]
            offs = n * stride_n + offs_s[:, None] * stride_s + offs_c[None, :] * stride_c
            x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            # (x - mean) * a rather than x * a - mean * a: no cancellation when |mean| >> std
            y = (x - mu[None, :]) * scale[None, :] + shift[None, :]
            if APPLY_SILU:
                y = y * tl.sigmoid(y)
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _add_operand(x, add):
    """`add` as the kernels read it: fp32 [N, C] with contiguous channels and any row stride (a [C] add is
    read with stride 0; a column slice of a wider [N, *] tensor, as engine/patches/emb_projections.py hands out, is
    read in place)."""
    if add.dim() == 1:
        add = add.unsqueeze(0).expand(x.shape[0], -1)
    add = add.to(torch.float32)
    return add if add.stride(1) == 1 else add.contiguous()


def _launch(x, num_groups, weight, bias, eps, activation, add=None):
    N, C = x.shape[0], x.shape[1]
    HW = x.numel() // (N * C)
    G, CG = num_groups, C // num_groups
    cl = is_channels_last(x)
    strides = (HW * C, 1, C) if cl else (C * HW, HW, 1)
    y = torch.empty_like(x)  # preserve_format: same strides as x, so channels_last stays channels_last
    add = _add_operand(x, add) if add is not None else None
    affine = (weight if weight is not None else y, bias if bias is not None else y,
              add if add is not None else y, add.stride(0) if add is not None else 0)
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, HAS_ADD=add is not None,
                 APPLY_SILU=activation == "silu")
    if one_program_per_group(C, HW, G):
        block_s, block_cg = max(2, next_pow2(HW)), max(2, next_pow2(CG))
        launch(_gn_group_kernel, (N * G,),
            x, y, *affine, C, HW, G, CG, *strides, float(eps),
            **flags, BLOCK_S=block_s, BLOCK_CG=block_cg,
            num_warps=min(16, max(4, block_s * block_cg // 1024)))
        return y
    block_s, block_c, K, KB, J, c_tiles, s_tiles, chunk_iters, nsc, apply_iters, block_p = tiling.split_config(
        N, C, HW, G, cl, sm_count(x.device))
    warps = tiling.WARPS or num_warps_for(block_s * block_c)
    # one fp32 workspace: PMEAN, PM2 [N, nsc, c_tiles, KB]
    ws = torch.empty(2 * N * nsc * c_tiles * KB, device=x.device, dtype=torch.float32)
    compiling = None
    try:
        launch(_gn_stats_kernel, (nsc, c_tiles, N),
            x, ws, affine[2], affine[3], N, C, HW, G, CG, *strides, nsc, chunk_iters, c_tiles, K, J,
            HAS_ADD=add is not None, BLOCK_S=block_s, BLOCK_C=block_c, KB=KB, num_warps=warps)
    except CompilingAhead as e:   # go on to the apply launch so that its compilation is submitted too
        compiling = e
    launch(_gn_apply_kernel, (cdiv(s_tiles, apply_iters), c_tiles, N),
        x, y, ws, *affine, N, C, HW, G, CG, *strides, nsc, chunk_iters * block_s, c_tiles, K, J,
        apply_iters, float(eps),
        **flags, BLOCK_S=block_s, BLOCK_C=block_c, KB=KB, BLOCK_P=block_p, num_warps=warps)
    if compiling is not None:
        raise compiling
    return y


def _plan(x, num_groups):
    """Which Triton path `_launch` takes: "one program per group" (one launch) or "split" (two)."""
    N, C = x.shape[0], x.shape[1]
    return "one program per group" if one_program_per_group(C, x.numel() // (N * C), num_groups) else "split"


def _add_fits(x, add):
    """Whether `add` is one value per (sample, channel) of x, on x's device: [N, C], or [C] for every sample."""
    shape = (x.shape[0],) + tuple(add.shape) if add.dim() == 1 else tuple(add.shape)
    return shape == tuple(x.shape[:2]) and add.device == x.device and add.is_floating_point()


def eligible(x, num_groups, weight=None, bias=None, add=None):
    """(True, "") when the Triton kernels handle these arguments, else (False, why)."""
    why = activation_ineligible(x, _DTYPES)
    if why:
        return False, why
    C = x.shape[1]
    if num_groups <= 0 or C % num_groups:
        return False, f"C={C} not divisible by num_groups={num_groups}"
    if C // num_groups > _MAX_GROUP_CHANNELS:
        return False, f"{C // num_groups} channels per group"
    why = vectors_ineligible(x, C, "C", weight=weight, bias=bias) or forward_only_ineligible(x, weight, bias)
    if why:
        return False, why
    if add is not None and not _add_fits(x, add):
        return False, "add is not one value per (sample, channel) on x's device"
    return True, ""


@fused_op(eligible=eligible, launch=_launch, plan=_plan)
def group_norm_silu(x, num_groups, weight=None, bias=None, eps=1e-5, activation="silu", add=None):
    """F.silu(F.group_norm(x + add, num_groups, weight, bias, eps)) (activation=None: the norm alone).

    `add`: optional [N, C] (or [C]) term added to x per sample and channel before the norm (a ResBlock's
    conv bias plus its timestep embedding): folded into the statistics, so it costs no pass over x.
    Runs the fused Triton kernels when `eligible`, else the reference; `group_norm_silu.last_call` says
    which ran (its `plan`: "one program per group", one launch, or "split", two). Output has x's dtype
    and memory format.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return x, num_groups, weight, bias, eps, activation, add


@group_norm_silu.fallback
def _reference_in_x_format(x, num_groups, weight, bias, eps, activation, add):
    y = group_norm_silu_reference(x, num_groups, weight, bias, eps, activation, add)
    if is_channels_last(x) and not y.is_contiguous(memory_format=torch.channels_last):
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
