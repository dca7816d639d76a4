#!/usr/bin/env python3
"""Where an accelerated sampling run's GPU time goes, kernel by kernel (a diagnosis, nothing for results.jsonl).

Per config (sd15_512_b1, sdxl_1024_b1 on random full-size checkpoints, dev/fixtures.py): Accelerated KSampler with
its defaults, one warm-up run (captures), then one run of --steps euler steps under torch's profiler, the sampler
alone (text encode and VAE decode outside it). Prints the wall ms per step, the GPU ms per step by kind of kernel,
and the --top kernels by GPU time with launches per step and µs per launch, so what a fusion could still remove
shows with its cost. Kernels inside replayed CUDA graphs are listed by name as eager ones are.

  python3 bench/diagnose_step_kernels.py --comfy-dir vendor/ComfyUI [--configs sdxl_1024_b1] [--top 45]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser()
cb.add_common_args(ap, deadline=240.0)
ap.add_argument("--configs", default="sdxl_1024_b1,sd15_512_b1")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--top", type=int, default=45)
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
torch = ENV.torch
GEOM = {"sd15_512_b1": ("sd15", 512, 1), "sd15_512_b4": ("sd15", 512, 4), "sdxl_1024_b1": ("sdxl", 1024, 1)}
LOADED = {}

# first match wins: cuDNN's attention kernels have "fprop" in their names as its convolutions do
KINDS = (("attention", ("sdpa", "flash", "fmha", "attention", "attn")),
         ("convolution", ("fprop", "conv", "implicit_convolve", "winograd", "dgrad")),
         ("GEMM", ("gemm", "nvjet", "cutlass", "gemv", "sm90_xmma")),
         ("ours (Triton)", ("_gn_", "group_norm", "layer_norm", "_geglu", "_bias_", "_residual", "_qkv", "triton")),
         ("copies, layout", ("copy", "cat", "transpose", "permute", "contiguous")))


def kind_of(kernel):
    name = kernel.lower()
    return next((kind for kind, marks in KINDS if any(m in name for m in marks)), "other elementwise")


def sample_once(model, pos, neg, lat, seed):
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    res = SDAccelKSampler().sample(model, seed, OPT.steps, 7.0, "euler", "normal", pos, neg, lat)
    return res["ui"]["text"][0]


def main():
    for tag in OPT.configs.split(","):
        kind, size, batch = GEOM[tag]
        size = 64 if OPT.smoke else size
        model, clip, vae = cb.load_family(ENV, OPT, kind, LOADED)
        with torch.inference_mode():
            pos = ENV.nodes.CLIPTextEncode().encode(clip, cb.POS)[0]
            neg = ENV.nodes.CLIPTextEncode().encode(clip, cb.NEG)[0]
            lat = ENV.nodes.EmptyLatentImage().generate(size, size, batch)[0]
            sample_once(model, pos, neg, lat, 1)
            cb.sync(ENV)
            t0 = time.perf_counter()
            line = sample_once(model, pos, neg, lat, 2)
            cb.sync(ENV)
            wall_ms = (time.perf_counter() - t0) * 1000.0 / OPT.steps
            times, counts = cb.cuda_kernel_times(ENV, lambda: sample_once(model, pos, neg, lat, 3))
        n = OPT.steps
        cb.say("KERNELS %s: wall %.2f ms/step unprofiled; GPU %.2f ms/step; report: %s"
               % (tag, wall_ms, sum(times.values()) / n, line[:300]))
        kinds = {}
        for k, ms in times.items():
            kinds[kind_of(k)] = kinds.get(kind_of(k), 0.0) + ms
        for kd, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
            cb.say("  %-20s %7.3f ms/step" % (kd, ms / n))
        cb.say("  %7s %7s %8s  %-18s %s" % ("ms/step", "n/step", "us/call", "kind", "kernel"))
        for k, ms in times.most_common(OPT.top):
            cb.say("  %7.3f %7.1f %8.1f  %-18s %s" % (ms / n, counts[k] / n, 1000.0 * ms / max(counts[k], 1),
                                                    kind_of(k)[:18], k[:100]))


if __name__ == "__main__":
    main()
