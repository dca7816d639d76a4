#!/usr/bin/env python3
"""An fp8-stored UNet (UNETLoader weight_dtype fp8_e4m3fn) against the same UNet in fp16, one process, same seeds.

#20 asks that a checkpoint stored in fp8 run through the Accelerated KSampler at least as fast as the same model
stored in fp16, lossless with respect to what ComfyUI computes for it. Per family (SD1.5 512² b1; `--families
sd15,sdxl` adds SDXL 1024²): the random checkpoint's UNet in fp16 (CheckpointLoaderSimple) and again through
UNETLoader fp8_e4m3fn, both resident; stock KSampler on the fp8 UNet, the Accelerated KSampler (defaults) on the
fp8 UNet and on the fp16 one, a warm-up of each, then rotated run by run (--reps each: the host's noise), medians.
One record per family (config `fp8_stored_<family>`): stock_its / ours_its on the fp8-stored UNet, `fp16_ours_its`
and `ratio_vs_fp16` (ours fp8-stored / ours fp16), psnr_db against stock's image (same fp8 weights), peak VRAM;
`as_stored_*`: the Accelerated KSampler with `fp8_weights` "as stored" (no fp16 copies: a group of layers cast at
a time at each step) on a second load of the fp8 UNet, its speed, peak and PSNR. It runs after the default variant
has made its copies in the same process, so its peak counts them too: `as_stored_peak_gib` is a speed run's peak,
not the VRAM "as stored" saves (`--peaks` measures that).

`--peaks` (a process of its own) measures what "as stored" saves instead: one load of the fp8 UNet and nothing
else on the GPU, stock KSampler, then the Accelerated KSampler "as stored", then with its fp16 copies (made only
then), a warm-up and --reps runs each in that order, the peak VRAM allocated over each variant's sampling runs
(warm-up and capture included). Config `fp8_stored_peaks_<family>`; its speeds are not rotated, so the speed
records are the default mode's.

`--weight-dtype fp8_e4m3fn_fast` loads the fp8 UNets as UNETLoader's fast choice does (ComfyUI's fp8_ops Linears;
configs *_fast).

`--profile` then runs one accelerated image of each UNet under torch's profiler and prints the CUDA kernels by GPU
time side by side (a diagnosis: which kernels make a difference between the two), with the layouts of the conv
weights and of their kept fp16 copies (engine/fp8/weights.py).

  python3 bench/bench_fp8_stored.py --comfy-dir vendor/ComfyUI --out $OUT [--families sd15,sdxl] [--profile]
  python3 bench/bench_fp8_stored.py --smoke --out /tmp/bench_fp8_stored
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap, deadline=300.0)
ap.add_argument("--families", default="sd15")
ap.add_argument("--steps", type=int, default=None, help="default 20 (3 with --smoke)")
ap.add_argument("--profile", action="store_true", help="also the kernels by GPU time of one image each")
ap.add_argument("--weight-dtype", default="fp8_e4m3fn", choices=("fp8_e4m3fn", "fp8_e4m3fn_fast"),
                help="UNETLoader's weight_dtype for the fp8 loads (fast: ComfyUI's fp8_ops Linears; configs *_fast)")
ap.add_argument("--peaks", action="store_true", help="the peak VRAM of stock, 'as stored' and 'fp16 copies' instead")
OPT = ap.parse_args()
if OPT.steps is None:
    OPT.steps = 3 if OPT.smoke else 20
ENV = cb.boot(OPT, ("checkpoints",))
sys.path.insert(0, os.path.join(cb.REPO, "dev"))
import folder_paths  # noqa: E402
import patch_nodes  # noqa: E402
folder_paths.add_model_folder_path("diffusion_models", os.path.join(OPT.work, "checkpoints"))
torch = ENV.torch
say = cb.say
LINES = []
SUFFIX = "_fast" if OPT.weight_dtype == "fp8_e4m3fn_fast" else ""
# variant: (model, sampler, Accelerated KSampler inputs)
VARIANTS = {"stock": ("fp8_stored", "stock", None), "ours": ("fp8_stored", "ours", None),
            "ours_as_stored": ("fp8_stored_2", "ours", {"fp8_weights": "as stored"}),
            "fp16_ours": ("fp16", "ours", None)}


def out(*a):
    s = " ".join(str(x) for x in a)
    LINES.append(s)
    print(s, flush=True)


def size_of(family):
    return 64 if OPT.smoke else {"sd15": 512, "sdxl": 1024}[family]


def layouts(model):
    """How many 3x3 conv weights (and their kept fp16 copies) are channels_last right now."""
    from sd_accel.engine.fp8 import weights
    convs = [m.weight for m in model.model.diffusion_model.modules()
             if isinstance(m, torch.nn.Conv2d) and m.weight is not None and m.weight.dim() == 4
             and m.weight.shape[2:] != (1, 1)]
    copies = [c for w in convs for c in weights.upcast_copies_of(w)]
    cl = lambda ts: sum(1 for t in ts if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last))  # noqa
    return "3x3 conv weights %d (%d channels_last, %s); kept fp16 copies %d (%d channels_last)" % (
        len(convs), cl(convs), convs[0].dtype if convs else None, len(copies), cl(copies))


def profile(family, models, clip, vae):
    size = size_of(family)
    prof = {}
    for name, model in models.items():
        prof[name] = cb.cuda_kernel_times(ENV, lambda: cb.run_graph(ENV, model, clip, vae, size, 1, 7, "ours", OPT.steps))
        out("%-10s after its run: %s" % (name, layouts(model)))
    (t16, n16), (t8, n8) = prof["fp16"], prof["fp8_stored"]
    out("kernels by GPU ms over one image of %d steps: fp16 | fp8_stored | diff | launches fp16 / fp8_stored | name"
        % OPT.steps)
    for k in sorted(set(t16) | set(t8), key=lambda k: -abs(t8.get(k, 0.0) - t16.get(k, 0.0)))[:30]:
        out("%9.2f %9.2f %+8.2f %6d / %-6d %s" % (t16.get(k, 0.0), t8.get(k, 0.0), t8.get(k, 0.0) - t16.get(k, 0.0),
                                                  n16.get(k, 0), n8.get(k, 0), k))
    out("total     %9.2f %9.2f   launches %d / %d" % (sum(t16.values()), sum(t8.values()), sum(n16.values()),
                                                       sum(n8.values())))


def copies_bytes():
    from sd_accel.engine.fp8 import weights
    return weights.bytes_on()


def measure(family, vers):
    fp16_model, clip, vae = cb.load_family(ENV, OPT, family, {})
    # "as stored" samples a UNet loaded a second time: on the same one the two variants' graphs (one per set of
    # modules) would take each other's place at every rotation, a capture per run that no user with one setting has
    name = "random_%s_fp16.safetensors" % family
    models = {"fp16": fp16_model, "fp8_stored": patch_nodes.load_fp8_unet(name, OPT.weight_dtype),
              "fp8_stored_2": patch_nodes.load_fp8_unet(name, OPT.weight_dtype)}
    size = size_of(family)

    def run(variant, seed):
        model, sampler, accel = VARIANTS[variant]
        return cb.run_graph(ENV, models[model], clip, vae, size, 1, seed, sampler, OPT.steps, accel=accel)

    first = {v: run(v, 1) for v in VARIANTS}
    runs = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    for i in range(OPT.reps):
        for v in order[i % len(order):] + order[:i % len(order)]:      # rotated: no variant always runs first
            runs[v].append(run(v, 100 + i))
    its = {v: OPT.steps / statistics.median(r["sample_s"] for r in runs[v]) for v in VARIANTS}
    for v in VARIANTS:
        out("%-10s %-10s %8.2f it/s (runs: %s)" % (family, v, its[v], ", ".join(
            "%.1f" % (OPT.steps / r["sample_s"]) for r in runs[v])))
    rec = dict(vers, date=datetime.date.today().isoformat(), config="fp8_stored_%s_%d_b1%s" % (family, size, SUFFIX),
               weight_dtype=OPT.weight_dtype, steps=OPT.steps, sampler="euler", scheduler="normal", cfg=7.0,
               stock_its=round(its["stock"], 2), ours_its=round(its["ours"], 2),
               speedup=round(its["ours"] / its["stock"], 3), fp16_ours_its=round(its["fp16_ours"], 2),
               ratio_vs_fp16=round(its["ours"] / its["fp16_ours"], 3),
               as_stored_its=round(its["ours_as_stored"], 2),
               as_stored_ratio_vs_fp16=round(its["ours_as_stored"] / its["fp16_ours"], 3),
               as_stored_peak_gib=round(max(r["peak_gib"] for r in runs["ours_as_stored"]), 3),
               fp16_ours_peak_gib=round(max(r["peak_gib"] for r in runs["fp16_ours"]), 3),
               fp16_copies_gib=round(copies_bytes() / 2 ** 30, 3),
               as_stored_psnr_db=round(cb.psnr(first["stock"]["img"], first["ours_as_stored"]["img"]), 2),
               first_run_s=round(first["ours"]["sample_s"] - statistics.median(r["sample_s"] for r in runs["ours"]), 2),
               stock_e2e_s=round(statistics.median(r["e2e_s"] for r in runs["stock"]), 3),
               ours_e2e_s=round(statistics.median(r["e2e_s"] for r in runs["ours"]), 3),
               stock_peak_gib=round(max(r["peak_gib"] for r in runs["stock"]), 3),
               ours_peak_gib=round(max(r["peak_gib"] for r in runs["ours"]), 3),
               psnr_db=round(cb.psnr(first["stock"]["img"], first["ours"]["img"]), 2),
               graphs=all("cuda_graph (" in (r["line"] or "") for r in runs["ours"]),
               notes="UNETLoader %s and the checkpoint's fp16 UNet both resident; stock KSampler and the "
                     "Accelerated KSampler (defaults) on the fp8 UNet, the Accelerated KSampler on the fp16 one, %d "
                     "rotated reps; ours fp8-stored: %s%s" % (
                         OPT.weight_dtype, OPT.reps, (runs["ours"][-1]["line"] or "")[:400],
                         "; smoke (CPU, tiny UNet)" if OPT.smoke else ""))
    if OPT.profile:
        profile(family, models, clip, vae)
    return rec


def peaks(family, vers):
    """--peaks: stock, "as stored", "fp16 copies" in that order on one load of the fp8 UNet (see the docstring)."""
    _, clip, vae = cb.load_family(ENV, OPT, family, {})     # its fp16 UNet is never sampled: never on the GPU
    model = patch_nodes.load_fp8_unet("random_%s_fp16.safetensors" % family, OPT.weight_dtype)
    size = size_of(family)
    variants = (("stock", "stock", None), ("as_stored", "ours", {"fp8_weights": "as stored"}), ("copies", "ours", None))
    runs = {}
    for name, sampler, accel in variants:
        runs[name] = [cb.run_graph(ENV, model, clip, vae, size, 1, 100 + i, sampler, OPT.steps, accel=accel)
                      for i in range(1 + OPT.reps)]
        r = runs[name]
        out("%-10s %-10s peak %.3f GiB, %.2f it/s (median of %d after a warm-up), %s" % (
            family, name, max(x["peak_gib"] for x in r), OPT.steps / statistics.median(x["sample_s"] for x in r[1:]),
            OPT.reps, (r[-1]["line"] or "")[:200]))
    weights_gib = sum(p.numel() * p.element_size() for p in model.model.diffusion_model.parameters()) / 2 ** 30
    its = {n: OPT.steps / statistics.median(x["sample_s"] for x in r[1:]) for n, r in runs.items()}
    peak = {n: max(x["peak_gib"] for x in r) for n, r in runs.items()}
    config = "fp8_stored_peaks_%s_%d_b1%s" % (family, size, SUFFIX)
    return dict(vers, date=datetime.date.today().isoformat(), config=config, weight_dtype=OPT.weight_dtype,
                steps=OPT.steps, sampler="euler", scheduler="normal", cfg=7.0,
                unet_weights_gib=round(weights_gib, 3), stock_peak_gib=round(peak["stock"], 3),
                as_stored_peak_gib=round(peak["as_stored"], 3), copies_peak_gib=round(peak["copies"], 3),
                fp16_copies_gib=round(copies_bytes() / 2 ** 30, 3), stock_its=round(its["stock"], 2),
                as_stored_its=round(its["as_stored"], 2), copies_its=round(its["copies"], 2),
                as_stored_psnr_db=round(cb.psnr(runs["stock"][0]["img"], runs["as_stored"][0]["img"]), 2),
                notes="one fp8 UNet load alone on the GPU; stock, then ours 'as stored', then ours with fp16 copies, "
                      "%d runs each after a warm-up, not rotated (speeds secondary); peak = max_memory_allocated "
                      "over each variant's sampling runs; as stored: %s%s" % (
                          OPT.reps, (runs["as_stored"][-1]["line"] or "")[:300],
                          "; smoke (CPU, tiny UNet)" if OPT.smoke else ""))


def main():
    vers = cb.versions(ENV, OPT.comfy_dir)
    with open(os.path.join(OPT.out, "results.jsonl"), "a") as f:
        for family in OPT.families.split(","):
            if time.time() - cb.T0 > OPT.deadline:
                say("SKIP", family, "past the deadline")
                continue
            rec = peaks(family, vers) if OPT.peaks else measure(family, vers)
            say("RESULT", json.dumps(rec))
            f.write(json.dumps(rec) + "\n")
    with open(os.path.join(OPT.out, "bench_fp8_stored.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
