#!/usr/bin/env python3
"""Where FreeU_V2's time goes on SDXL 1024² b1, on the GPU machine: a diagnosis, not a benchmark (no record).

1. Accelerated KSampler (graphs on) on the plain model and under FreeU_V2: ms per step, alternating runs.
2. The CUDA kernels FreeU_V2 adds to one eager run of ours (graphs off): per-kernel GPU ms, FreeU minus plain.
3. ComfyUI's Fourier_filter alone at each skip-connection shape FreeU_V2 filters in an SDXL UNet at 1024²
   (CFG batch 2), its input contiguous or channels_last (what our fused blocks hand it), and SD Accel's
   kernels/fourier_low_scale.py on the same input: GPU ms per call, replayed from a CUDA graph so that launch
   gaps do not count, and the largest difference between the two outputs.

  python3 bench/diagnose_freeu.py --comfy-dir vendor/ComfyUI --out $OUT
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser()
cb.add_common_args(ap, deadline=240.0)
ap.add_argument("--steps", type=int, default=20)
OPT = ap.parse_args()
SIZE = 64 if OPT.smoke else 1024
ENV = cb.boot(OPT, ("checkpoints",))
torch = ENV.torch
say = cb.say
import patch_nodes  # noqa: E402  (dev/, on the path after boot)
from comfy_extras.nodes_freelunch import Fourier_filter  # noqa: E402
from sd_accel.kernels.fourier_low_scale import fourier_low_scale  # noqa: E402
from kernel_timing import graph_us  # noqa: E402

# (channels of hsp, side) of each skip FreeU_V2 filters in SDXL's output blocks 0-6 at 1024² (latent 128²)
SDXL_SKIPS = [(1280, 32), (1280, 32), (640, 32), (640, 64), (640, 64), (320, 64), (320, 128)]


def step_ms(model, clip, vae, variant_accel):
    runs = []
    for seed in range(100, 100 + OPT.reps):
        out = cb.run_graph(ENV, model, clip, vae, SIZE, 1, seed, "ours", OPT.steps, accel=variant_accel)
        runs.append(out["sample_s"] * 1000.0 / OPT.steps)
    return statistics.median(runs), out["line"]


def main():
    model, clip, vae = cb.load_family(ENV, OPT, "sdxl", {})
    freeu = patch_nodes.apply_case(model, patch_nodes.cases(SIZE)["FreeU_V2"])
    for m in (model, freeu):   # warm-up: captures
        cb.run_graph(ENV, m, clip, vae, SIZE, 1, 1, "ours", OPT.steps)
    plain_ms, line = step_ms(model, clip, vae, None)
    freeu_ms, fline = step_ms(freeu, clip, vae, None)
    say("graphs: plain %.2f ms/step, FreeU_V2 %.2f ms/step (+%.2f)" % (plain_ms, freeu_ms, freeu_ms - plain_ms))
    say("  plain: %s\n  FreeU_V2: %s" % (line, fline))

    eager = {"cuda_graph": False}
    with torch.inference_mode():
        t_plain, _ = cb.cuda_kernel_times(ENV, lambda: cb.run_graph(ENV, model, clip, vae, SIZE, 1, 7, "ours",
                                                                    OPT.steps, accel=eager))
        t_freeu, n_freeu = cb.cuda_kernel_times(ENV, lambda: cb.run_graph(ENV, freeu, clip, vae, SIZE, 1, 7, "ours",
                                                                          OPT.steps, accel=eager))
    diff = {k: t_freeu[k] - t_plain.get(k, 0.0) for k in t_freeu}
    total = sum(diff.values()) / OPT.steps
    say("eager kernels FreeU_V2 adds: %.2f ms/step GPU; largest (ms/step, launches/step):" % total)
    for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:20]:
        say("  %7.3f  %5d  %s" % (v / OPT.steps, n_freeu[k] // OPT.steps, k))

    if not ENV.cuda:
        return
    with torch.inference_mode():
        tot = {}
        for c, side in SDXL_SKIPS:
            x = torch.randn(2, c, side, side, device="cuda", dtype=torch.float16)
            for fmt, xx in (("contiguous", x), ("channels_last", x.to(memory_format=torch.channels_last))):
                stock_ms = graph_us(lambda: Fourier_filter(xx, threshold=1, scale=0.2)) / 1000
                ours_ms = graph_us(lambda: fourier_low_scale(xx, 1, 0.2)) / 1000
                assert fourier_low_scale.last_call.path == "triton", fourier_low_scale.last_call
                diff = (fourier_low_scale(xx, 1, 0.2).float() - Fourier_filter(xx, threshold=1, scale=0.2).float())
                tot[fmt] = [a + b for a, b in zip(tot.get(fmt, (0.0, 0.0)), (stock_ms, ours_ms))]
                say("filter 2x%dx%dx%d %s: stock %.3f ms, ours %.3f ms, max |diff| %.2e"
                    % (c, side, side, fmt, stock_ms, ours_ms, diff.abs().max().item()))
        for fmt, (stock_ms, ours_ms) in tot.items():
            say("filter over SDXL's seven skips, %s: stock %.3f ms, ours %.3f ms" % (fmt, stock_ms, ours_ms))


main()
