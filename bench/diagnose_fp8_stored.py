#!/usr/bin/env python3
"""Why the Accelerated KSampler runs an fp8-stored UNet (UNETLoader weight_dtype fp8_e4m3fn) slower than the same
UNet loaded in fp16: a diagnosis, not a benchmark (nothing for results.jsonl; bench_patches.py records the
`patch_unetloader_fp8_e4m3fn` config).

One process, SD1.5 512² b1 (`--family sdxl`: 1024²): the random checkpoint's UNet in fp16 and as fp8-stored,
each through the Accelerated KSampler with graphs, alternating (--reps each); then one run of each under the
profiler: CUDA kernels by GPU time side by side, kernel counts, and the layout of the conv weights and of their
kept fp16 copies (engine/fp8/weights.py) after the run's first step. Where the two step times differ, the table
says which kernels make the difference.

  python3 bench/diagnose_fp8_stored.py --comfy-dir vendor/ComfyUI --out $OUT [--family sdxl]
"""
import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap)
ap.add_argument("--family", default="sd15")
ap.add_argument("--steps", type=int, default=20)
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
sys.path.insert(0, os.path.join(cb.REPO, "dev"))
import folder_paths  # noqa: E402
import patch_nodes  # noqa: E402
folder_paths.add_model_folder_path("diffusion_models", os.path.join(OPT.work, "checkpoints"))
torch = ENV.torch
SIZE = 64 if OPT.smoke else {"sd15": 512, "sdxl": 1024}[OPT.family]
LINES = []


def out(*a):
    s = " ".join(str(x) for x in a)
    LINES.append(s)
    print(s, flush=True)


def run(model, clip, vae, seed):
    return cb.run_graph(ENV, model, clip, vae, SIZE, 1, seed, "ours", OPT.steps)


def kernels(model, clip, vae):
    """(GPU ms per kernel name, launches per kernel name) over one accelerated run."""
    times, counts = collections.Counter(), collections.Counter()
    if not ENV.cuda:
        return times, counts
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(model, clip, vae, 7)
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.key[:100]] += e.device_time_total / 1000.0
            counts[e.key[:100]] += e.count
    return times, counts


def layouts(model):
    """How many conv weights (and their kept fp16 copies) are channels_last / NCHW right now."""
    from sd_accel.engine.fp8 import weights
    convs = [m.weight for m in model.model.diffusion_model.modules()
             if isinstance(m, torch.nn.Conv2d) and m.weight is not None and m.weight.dim() == 4
             and m.weight.shape[2:] != (1, 1)]
    copies = [c for w in convs for c in weights.upcast_copies_of(w)]
    cl = lambda ts: sum(1 for t in ts if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last))  # noqa
    return "3x3 conv weights %d (%d channels_last, dtype %s); kept copies %d (%d channels_last)" % (
        len(convs), cl(convs), convs[0].dtype if convs else None, len(copies), cl(copies))


def main():
    fp16_model, clip, vae = cb.load_family(ENV, OPT, OPT.family, {})
    fp8_model = patch_nodes.load_fp8_unet("random_%s_fp16.safetensors" % OPT.family)
    models = {"fp16": fp16_model, "fp8_stored": fp8_model}
    for name, m in models.items():
        r = run(m, clip, vae, 1)
        out("%-10s warm-up: %s" % (name, r["line"][:300]))
    its = {name: [] for name in models}
    for i in range(OPT.reps):
        for name, m in models.items():
            its[name].append(OPT.steps / run(m, clip, vae, 100 + i)["sample_s"])
    for name in models:
        out("%-10s %.2f it/s (median of %d: %s)" % (name, statistics.median(its[name]), OPT.reps,
                                                    ", ".join("%.1f" % v for v in its[name])))
    prof = {}
    for name, m in models.items():
        prof[name] = kernels(m, clip, vae)
        out("%-10s after its run: %s" % (name, layouts(m)))
    (t16, n16), (t8, n8) = prof["fp16"], prof["fp8_stored"]
    out("kernels by GPU ms over one run of %d steps: fp16 | fp8_stored | diff | launches fp16 / fp8_stored | name"
        % OPT.steps)
    names = sorted(set(t16) | set(t8), key=lambda k: -abs(t8.get(k, 0.0) - t16.get(k, 0.0)))
    for k in names[:30]:
        out("%9.2f %9.2f %+8.2f %6d / %-6d %s" % (t16.get(k, 0.0), t8.get(k, 0.0), t8.get(k, 0.0) - t16.get(k, 0.0),
                                                  n16.get(k, 0), n8.get(k, 0), k))
    out("total     %9.2f %9.2f   launches %d / %d" % (sum(t16.values()), sum(t8.values()), sum(n16.values()),
                                                       sum(n8.values())))
    with open(os.path.join(OPT.out, "diagnose_fp8_stored_%s.txt" % OPT.family), "w") as f:
        f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
