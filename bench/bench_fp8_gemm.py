"""Times the FP8 Linear's ways on the transformer Linears of SD1.5 512² and SDXL 1024² (CFG batch 2), GPU time
in CUDA-graph replay (kernel_timing.graph_us), sm_89/sm_90 only:

  fp16        F.linear in fp16 (cuBLAS): what precision fp16 runs; for a GEGLU row, the projection then
              kernels/geglu.py, as the fp16 path runs them
  scaled_mm   quantize_rows + torch._scaled_mm rowwise (bf16 out) + cast + bias: the FP8 path before fp8_gemm
  ours        quantize_rows + kernels/fp8_gemm.py (scales, bias and GEGLU in the epilogue), its chosen config
  gemm only   fp8_gemm alone (the activations already quantized), chosen config and, with --sweep, the
              fastest of the swept configs (which one is printed: how config_for's constants were chosen)
  cuBLAS fp8  torch._scaled_mm alone on the same quantized operands, one scale per tensor, bf16 out (both
              halves for a GEGLU row; no epilogue): how fast an FP8 GEMM of this shape runs on this GPU

    python bench/bench_fp8_gemm.py [--sweep] [--models sdxl] [--out DIR]

TFLOP/s count 2*M*N*K of the GEMM (both halves for a GEGLU row). Every row checks ours against the fp32
reference of the dequantized operands.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import graph_us, save_lines  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sd_accel.kernels.fp8_gemm import Config, config_for, fp8_gemm, fp8_gemm_reference  # noqa: E402
from sd_accel.kernels.geglu import geglu  # noqa: E402
from sd_accel.kernels.quantize_rows import quantize_rows, quantize_weight_per_channel  # noqa: E402

# (model, M tokens of the CFG batch, K in, N out, geglu): each width's q/k/v/out projection, GEGLU projection
# (N = both halves) and feed-forward output
SHAPES = []
for _model, _levels in (("sd15", ((8192, 320), (2048, 640), (512, 1280))),
                        ("sdxl", ((8192, 640), (2048, 1280)))):
    for _m, _c in _levels:
        SHAPES += [(_model, _m, _c, _c, False), (_model, _m, _c, 8 * _c, True), (_model, _m, 4 * _c, _c, False)]

SWEEP = [Config(bm, bn, bk, w, s) for bm, bn, w in ((128, 128, 8), (128, 256, 8), (64, 128, 4), (128, 64, 4),
                                                    (64, 256, 8), (256, 128, 8))
         for bk, stages in ((64, (3, 4)), (128, (3, 4)), (256, (2, 3))) for s in stages]


def scaled_mm_path(x, wq, ws, bias):
    xq, xs = quantize_rows(x)
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16).to(torch.float16)
    return out.add_(bias)


def row(model, M, K, N, is_geglu, sweep):
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).half()
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    wq, ws = quantize_weight_per_channel(w)
    xq, xs = quantize_rows(x)
    flop = 2 * M * N * K
    fp16 = (lambda: geglu(F.linear(x, w, b))) if is_geglu else (lambda: F.linear(x, w, b))
    ours = lambda: fp8_gemm(*quantize_rows(x), wq, ws, b, geglu=is_geglu)  # noqa: E731
    got = fp8_gemm(xq, xs, wq, ws, b, geglu=is_geglu)
    assert fp8_gemm.last_call.path == "triton", fp8_gemm.last_call
    err = (got.float() - fp8_gemm_reference(xq, xs, wq, ws, b, geglu=is_geglu).float()).abs().max().item()
    t16, t_ours = graph_us(fp16), graph_us(ours)
    t_mm = None if is_geglu else _try(lambda: graph_us(lambda: scaled_mm_path(x, wq, ws, b)))
    one = torch.ones((), device="cuda")
    t_cublas8 = _try(lambda: graph_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                                out_dtype=torch.bfloat16)))
    chosen = config_for(M, N // 2 if is_geglu else N, K, is_geglu)
    t_gemm = graph_us(lambda: fp8_gemm(xq, xs, wq, ws, b, geglu=is_geglu))
    best = (t_gemm, chosen)
    if sweep:
        for cfg in SWEEP:
            if K % cfg[2]:
                continue
            t = _try(lambda cfg=cfg: graph_us(lambda: fp8_gemm(xq, xs, wq, ws, b, geglu=is_geglu, config=cfg)))
            if t is not None and t < best[0]:
                best = (t, cfg)
    tf = lambda t: flop / (t * 1e-6) / 1e12  # noqa: E731
    return ("%-5s %6d %6d %6d %-5s %9.1f %9s %9.1f %6.2fx %9.1f %6.0f %6.0f %9.1f %-24s %9s %6s %8.1e" % (
        model, M, K, N, "yes" if is_geglu else "", t16, "%.1f" % t_mm if t_mm else "-", t_ours, t16 / t_ours,
        t_gemm, tf(t16), tf(t_gemm), best[0], tuple(best[1]), "%.1f" % t_cublas8 if t_cublas8 else "-",
        "%.0f" % tf(t_cublas8) if t_cublas8 else "-", err))


def _try(fn):
    try:
        return fn()
    except Exception as e:  # a config that does not fit shared memory, a recipe this torch lacks
        print("  (skipped: %s)" % str(e).splitlines()[0][:120], flush=True)
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--models", default="sd15,sdxl", help="comma-separated: which models' shapes")
    ap.add_argument("--out", default=None)
    opt = ap.parse_args()
    torch.manual_seed(0)
    lines = ["%-5s %6s %6s %6s %-5s %9s %9s %9s %7s %9s %6s %6s %9s %-24s %9s %6s %8s" % (
        "model", "M", "K", "N", "geglu", "fp16 us", "s_mm us", "ours us", "x fp16", "gemm us", "TF16", "TF8",
        "best us", "best config", "cuBLAS8us", "TFcb8", "max err")]
    print(lines[0], flush=True)
    for shape in [s for s in SHAPES if s[0] in opt.models.split(",")]:
        lines.append(row(*shape, opt.sweep))
        print(lines[-1], flush=True)
    save_lines(opt.out, "fp8_gemm.txt", lines)


if __name__ == "__main__":
    main()
