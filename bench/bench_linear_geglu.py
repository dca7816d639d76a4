"""GEGLU's projection + activation: cuBLAS Linear then SD Accel's GEGLU kernel (what a fused transformer block
ran before), against kernels/linear_geglu.py over a sweep of tilings, on the feed-forwards of real SD steps
(CFG batch 2), CUDA-graph replay times (GPU time alone, as a graphed step pays). GPU only.

    python bench/bench_linear_geglu.py [--dtype fp16|bf16] [--out DIR]

Prints per shape the two-kernel time, each tiling's, the best and its speed-up, and the error of both against
an fp32 reference; the last line is the `_config` table the best tilings suggest. Nothing for results.jsonl
(a kernel sweep); the UNet benchmarks measure what the choice does to a step.
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import DTYPES, graph_us  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sd_accel.kernels import linear_geglu as lg  # noqa: E402
from sd_accel.kernels.geglu import geglu  # noqa: E402

# (tag, M = CFG batch x tokens, K = channels, D = 4 x channels): every transformer level of each config
SHAPES = [
    ("sd15_512 l1", 8192, 320, 1280), ("sd15_512 l2", 2048, 640, 2560), ("sd15_512 l3", 512, 1280, 5120),
    ("sd15_768 l1", 18432, 320, 1280), ("sd15_768 l2", 4608, 640, 2560), ("sd15_768 l3", 1152, 1280, 5120),
    ("sdxl_1024 l2", 8192, 640, 2560), ("sdxl_1024 l3", 2048, 1280, 5120),
    ("sd15_512_b4 l1", 32768, 320, 1280),
]
TILINGS = [(bm, bn, bk, w, s) for (bm, bn, bk), w, s in itertools.product(
    [(128, 128, 64), (64, 128, 64), (128, 64, 64), (64, 64, 64), (128, 128, 32), (128, 256, 64)], (4, 8), (3, 4))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="", help="comma-separated tags (default: all)")
    opt = ap.parse_args()
    dtype = DTYPES[opt.dtype]
    torch.manual_seed(0)
    lines, best_rows = [], []

    def say(s):
        print(s, flush=True)
        lines.append(s)
    for tag, M, K, D in SHAPES:
        if opt.shapes and tag not in opt.shapes.split(","):
            continue
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        w = torch.randn(2 * D, K, device="cuda", dtype=dtype) / K ** 0.5
        b = torch.randn(2 * D, device="cuda", dtype=dtype) * 0.1
        ref = lg.linear_geglu_reference(x.float(), w.float(), b.float())
        scale = ref.abs().max().item()
        two = graph_us(lambda: geglu(F.linear(x, w, b)))
        err_two = (geglu(F.linear(x, w, b)).float() - ref).abs().max().item() / scale
        results = []
        for t in TILINGS:
            os.environ["SDACCEL_LINEAR_GEGLU_CONFIG"] = ",".join(map(str, t))
            try:
                out = lg.linear_geglu(x, w, b)
                if lg.linear_geglu.last_path != "triton":
                    raise RuntimeError(lg.linear_geglu.last_reason)
                err = (out.float() - ref).abs().max().item() / scale
                results.append((graph_us(lambda: lg.linear_geglu(x, w, b)), t, err))
            except Exception as e:  # noqa: BLE001 - a tiling that does not fit (shared memory): skipped
                say("  %s %s: %s" % (tag, t, str(e).splitlines()[0][:120]))
        os.environ.pop("SDACCEL_LINEAR_GEGLU_CONFIG", None)
        results.sort()
        flops = 2 * M * K * 2 * D
        say("%-15s M=%5d K=%4d D=%5d  cuBLAS+GEGLU %7.1f us (%4.0f TFLOP/s, err %.1e) | best %7.1f us %s "
            "(%4.0f TFLOP/s, err %.1e): %.2fx" % (
                tag, M, K, D, two, flops / two / 1e6, err_two, results[0][0], results[0][1],
                flops / results[0][0] / 1e6, results[0][2], two / results[0][0]))
        say("    next: " + "; ".join("%.1f %s" % (us, t) for us, t, _ in results[1:6]))
        default = lg._config(M, K, D)
        d = [r for r in results if r[1] == default]
        if d:
            say("    current _config %s: %.1f us (%.2fx)" % (default, d[0][0], two / d[0][0]))
        best_rows.append((tag, M, K, D, results[0][1], two / results[0][0]))
    say("best tilings: " + "; ".join("%s %s %.2fx" % (t, c, s) for t, M, K, D, c, s in best_rows))
    if opt.out:
        os.makedirs(opt.out, exist_ok=True)
        with open(os.path.join(opt.out, "linear_geglu.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
