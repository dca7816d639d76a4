#!/usr/bin/env python3
"""A trial, not product code: would the FP8 GEMM of kernels/fp8_gemm.py get closer to cuBLAS's FP8 GEMM with its
operands loaded through Hopper's tensor memory accelerator (TMA) instead of per-thread pointer loads?

On SDXL's shapes cuBLAS's FP8 GEMM (`torch._scaled_mm`, no epilogue) ran 1.2-1.6x faster than ours (bench/RESULTS.md,
session 23); the launch-shape sweep found nothing more. The kernel here is the same GEMM with the same epilogue
(per-row and per-channel scales, bias, GEGLU of the two halves) whose A and B tiles come from device-side tensor
descriptors (`tl.make_tensor_descriptor`: Triton builds the TMA descriptor in a scratch buffer it allocates per
launch through `triton.set_allocator`), pipelined by `tl.range(num_stages=...)`; optionally persistent (one program
per SM looping over tiles). Per SDXL transformer Linear (CFG batch 2, 1024²): ours with its chosen config, the TMA
kernel over a few launch shapes, and cuBLAS's FP8 GEMM, GPU µs per call replayed from a CUDA graph, each checked
against the fp32 reference of the dequantized operands. If it wins, it moves into kernels/fp8_gemm.py, measured
again there through the UNet (bench_fp8.py); until then nothing uses it.

    python3 bench/fp8_gemm_tma_trial.py [--out DIR]          (GPU, sm_90; Triton >= 3.4)
    TRITON_INTERPRET=1 python3 bench/fp8_gemm_tma_trial.py --check   (CPU: the kernel against the reference only)
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--check" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
from kernel_timing import graph_us, save_lines  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sd_accel.kernels.fp8_gemm import config_for, fp8_gemm, fp8_gemm_reference  # noqa: E402
from sd_accel.kernels.quantize_rows import quantize_rows, quantize_weight_per_channel  # noqa: E402

# (M tokens, K in, N out, geglu): SDXL 1024²'s q/k/v/out, GEGLU and feed-forward output projections, CFG batch 2
SHAPES = [(8192, 640, 640, False), (8192, 640, 5120, True), (8192, 2560, 640, False),
          (2048, 1280, 1280, False), (2048, 1280, 10240, True), (2048, 5120, 1280, False)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, persistent)
TRIALS = [(128, 128, 128, 8, 3, False), (128, 128, 128, 8, 4, False), (128, 64, 128, 4, 4, False),
          (128, 256, 128, 8, 3, False), (128, 128, 128, 8, 4, True), (128, 64, 128, 4, 4, True)]


@triton.jit
def _tma_fp8_gemm_kernel(A, XS, B, WS, BIAS, C, M, N, K, N_PROGS,
                         HAS_BIAS: tl.constexpr, GEGLU: tl.constexpr, PERSISTENT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP: tl.constexpr, STAGES: tl.constexpr):
    n_all = 2 * N if GEGLU else N
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(B, shape=[n_all, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    step = N_PROGS if PERSISTENT else tiles
    for tile in range(tl.program_id(0), tiles, step):
        in_group = GROUP * tiles_n
        first_m = (tile // in_group) * GROUP
        group_rows = min(tiles_m - first_m, GROUP)
        pid_m = first_m + (tile % in_group) % group_rows
        pid_n = (tile % in_group) // group_rows
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            a = a_desc.load([off_m, k0])
            acc = tl.dot(a, b_desc.load([off_n, k0]).T, acc)
            if GEGLU:
                acc_g = tl.dot(a, b_desc.load([N + off_n, k0]).T, acc_g)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        xs = tl.load(XS + rows, mask=row_ok, other=0.0)[:, None]
        out = acc * xs * tl.load(WS + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            out += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GEGLU:
            gate = acc_g * xs * tl.load(WS + N + cols, mask=col_ok, other=0.0)[None, :]
            if HAS_BIAS:
                gate += tl.load(BIAS + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            out = out.to(tl.float16).to(tl.float32)
            gate = gate.to(tl.float16).to(tl.float32)
            out = out * (0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)))
        tl.store(C + rows[:, None].to(tl.int64) * N + cols[None, :], out.to(tl.float16),
                 mask=row_ok[:, None] & col_ok[None, :])


def _scratch(size, alignment, stream):
    """Where Triton writes each launch's TMA descriptors (device-side `make_tensor_descriptor`)."""
    return torch.empty(size, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.int8)


def tma_fp8_gemm(xq, xs, wq, ws, bias, geglu, trial):
    bm, bn, bk, warps, stages, persistent = trial
    M, K = xq.shape
    N = wq.shape[0] // 2 if geglu else wq.shape[0]
    out = torch.empty((M, N), device=xq.device, dtype=torch.float16)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    sms = torch.cuda.get_device_properties(xq.device).multi_processor_count if xq.is_cuda else 4
    progs = min(tiles, sms) if persistent else tiles
    _tma_fp8_gemm_kernel[(progs,)](xq, xs, wq, ws, bias if bias is not None else ws, out, M, N, K, progs,
                                   HAS_BIAS=bias is not None, GEGLU=geglu, PERSISTENT=persistent, BLOCK_M=bm,
                                   BLOCK_N=bn, BLOCK_K=bk, GROUP=8, STAGES=stages, num_warps=warps)
    return out


def _operands(M, K, N, geglu, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(device, torch.float16)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, torch.float16)
    b = torch.randn(N, generator=g).to(device, torch.float16)
    return x, quantize_weight_per_channel(w), b


def check(shapes, trials):
    """The TMA kernel against the fp32 reference of the dequantized operands (and the product kernel's own
    result), at each shape and trial; raises on a mismatch."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for M, K, N, geglu in shapes:
        x, (wq, ws), b = _operands(M, K, N, geglu, device)
        xq, xs = quantize_rows(x)
        ref = fp8_gemm_reference(xq, xs, wq, ws, b, geglu=geglu).float()
        # the product kernel's own error is the bar: Hopper's FP8 MMA accumulates below fp32, which grows with K
        bar = max(2e-3, 1.5 * float((fp8_gemm(xq, xs, wq, ws, b, geglu=geglu).float() - ref).abs().max()
                                    / ref.abs().max()))
        for trial in trials:
            try:
                got = tma_fp8_gemm(xq, xs, wq, ws, b, geglu, trial).float()
            except triton.runtime.errors.OutOfResources as e:   # GEGLU's second tile set can overflow shared memory
                print("  (trial %s does not fit at this shape: %s)" % (trial, str(e).splitlines()[0][:100]), flush=True)
                continue
            err = float((got - ref).abs().max() / ref.abs().max())
            assert err < bar, ((M, K, N, geglu), trial, err, bar)
        print("check ok: M %d K %d N %d geglu %s, %d trials" % (M, K, N, geglu, len(trials)), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="CPU: check the kernel on small shapes, time nothing")
    opt = ap.parse_args()
    triton.set_allocator(_scratch)
    if opt.check:
        check([(96, 128, 80, False), (64, 256, 96, True)],
              [(32, 32, 64, 4, 2, False), (32, 16, 64, 4, 2, True), (64, 32, 128, 4, 2, False)])
        return
    check([(M, K, N, g) for M, K, N, g in SHAPES], TRIALS)
    lines = ["%6s %6s %6s %-5s %9s %9s %s %10s" % ("M", "K", "N", "geglu", "ours us", "ours TF",
                                                   " ".join("%12s" % ("tma%d" % i) for i in range(len(TRIALS))),
                                                   "cuBLAS8 us")]
    for M, K, N, geglu in SHAPES:
        x, (wq, ws), b = _operands(M, K, N, geglu, "cuda")
        xq, xs = quantize_rows(x)
        n_all = 2 * N if geglu else N
        tf = lambda us: 2 * M * n_all * K / (us * 1e-6) / 1e12  # noqa: E731
        t_ours = graph_us(lambda: fp8_gemm(xq, xs, wq, ws, b, geglu=geglu))
        assert fp8_gemm.last_call.path == "triton", fp8_gemm.last_call
        trial_us = []
        for trial in TRIALS:
            try:
                trial_us.append(graph_us(lambda trial=trial: tma_fp8_gemm(xq, xs, wq, ws, b, geglu, trial)))
            except Exception as e:  # noqa: BLE001 - a launch shape that does not fit: say so, go on
                print("  (trial %s skipped: %s)" % (trial, str(e).splitlines()[0][:120]), flush=True)
                trial_us.append(None)
        one = torch.ones((), device="cuda")
        t_cb = graph_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        cells = " ".join("%5.1f (%4.0f)" % (t, tf(t)) if t else "%12s" % "-" for t in trial_us)
        lines.append("%6d %6d %6d %-5s %9.1f %9.0f %s %10.1f   ours' config %s" % (
            M, K, N, "yes" if geglu else "", t_ours, tf(t_ours), cells, t_cb,
            tuple(config_for(M, N, K, geglu))))
        print(lines[-1], flush=True)
    lines.append("trials (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, persistent): %s" % TRIALS)
    print(lines[-1])
    save_lines(opt.out, "fp8_gemm_tma_trial.txt", lines)


if __name__ == "__main__":
    main()
