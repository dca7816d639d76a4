#!/usr/bin/env python3
"""precision fp8 (LOSSY) against stock and against SD Accel at fp16, in one process, same seeds (issue #20).

GPU machine (sm_89/sm_90 for FP8 to engage; elsewhere the fp8 column runs fp16 and its notes say why). Per config
(sd15_512_b1, sd15_512_b4, sdxl_1024_b1 on random full-size checkpoints, dev/fixtures.py): stock KSampler,
Accelerated KSampler at fp16 and at fp8 through comfy_bench.run_graph; it/s (median of --reps), peak VRAM, the
final image's PSNR of fp8 vs ours-fp16, and one UNet forward's relative error, fp8 vs fp16. Then the per-layer
relative error of the FP8 Linear on random weights and on weights/activations with heavy-tailed outlier
channels (a few channels 10-100x). Appends `<config>_fp8` records (../shared/BENCH.md) to $OUT/results.jsonl.

  python3 bench/bench_fp8.py --comfy-dir vendor/ComfyUI --out $OUT [--configs sd15_512_b1,...] [--profile]
With --profile, one image of ours fp16 and of ours fp8 per config under torch's profiler: GPU time by kind of kernel
(GEMMs, FP8 GEMMs, convolutions, attention, our norm kernels, the rest), which bounds what FP8 on one kind can give.
Not covered yet: the fp8-stored checkpoint (UNETLoader weight_dtype fp8_e4m3fn) at precision fp16.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser()
cb.add_common_args(ap, deadline=280.0)
ap.add_argument("--configs", default="sd15_512_b1,sd15_512_b4,sdxl_1024_b1")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--profile", action="store_true", help="also GPU time by kind of kernel, ours fp16 vs fp8")
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
torch = ENV.torch
GEOM = {"sd15_512_b1": ("sd15", 512, 1), "sd15_512_b4": ("sd15", 512, 4), "sdxl_1024_b1": ("sdxl", 1024, 1)}
LOADED = {}


def measure(model, clip, vae, size, batch, sampler, accel=None):
    """Warm-up run, then the median of --reps timed runs (comfy_bench.run_graph)."""
    run = lambda seed: cb.run_graph(ENV, model, clip, vae, size, batch, seed, sampler, OPT.steps,  # noqa: E731
                                    accel=accel)
    first = run(1)
    runs = [run(100 + r) for r in range(OPT.reps)]
    med = statistics.median(r["sample_s"] for r in runs)
    return {"its": OPT.steps / med, "sample_s": med, "e2e_s": statistics.median(r["e2e_s"] for r in runs),
            "peak_gib": max(r["peak_gib"] for r in runs), "first_s": first["sample_s"], "img": runs[0]["img"],
            "report": runs[-1]["report"]}


def unet_fp8_rel_err(model, size, batch):
    """One diffusion-model forward of the fp8 clone vs the fp16 clone (Apply SD Accel's, graphs off), same input."""
    from sd_accel.hosts.comfyui import accelerate as host
    bm = model.model
    g = torch.Generator(device=ENV.dev).manual_seed(7)
    dt = bm.get_dtype()
    x = torch.randn((2 * batch, 4, size // 8, size // 8), device=ENV.dev, dtype=dt, generator=g)
    t = torch.full((2 * batch,), 500.0, device=ENV.dev)
    ctx = torch.randn((2 * batch, 77, bm.model_config.unet_config["context_dim"]), device=ENV.dev, dtype=dt,
                      generator=g)
    adm = bm.model_config.unet_config.get("adm_in_channels")
    kw = {"y": torch.randn((2 * batch, adm), device=ENV.dev, dtype=dt, generator=g)} if adm else {}
    outs = []
    for precision in ("fp16", "fp8"):
        clone, _ = host.accelerate(model, host.AccelOptions(cuda_graph=False, precision=precision))
        with torch.inference_mode():
            ENV.mm.load_models_gpu([clone])
            outs.append(clone.model.diffusion_model(x, t, context=ctx, **kw).float())
    return float((outs[1] - outs[0]).norm() / outs[0].norm())


def layer_errors():
    """{case: rel. error} of one FP8 Linear (SDXL's 1280 -> 5120 feed-forward width, 4096 tokens) vs fp32."""
    from sd_accel.engine.fp8.linear import make_fp8_linear
    out = {}
    for case in ("random", "outliers"):
        g = torch.Generator().manual_seed(3)
        lin = torch.nn.Linear(1280, 5120).to(ENV.dev, torch.float16)
        x = torch.randn(4096, 1280, generator=g)
        if case == "outliers":
            with torch.no_grad():
                lin.weight[:4] *= torch.tensor([10.0, 30.0, 60.0, 100.0], device=ENV.dev, dtype=torch.float16)[:, None]
                lin.weight[:, :3] *= 50
            x[:, 7] *= 100
            x[:, 11] *= 20
        x = x.to(ENV.dev, torch.float16)
        with torch.no_grad():
            ref = torch.addmm(lin.bias.float(), x.float(), lin.weight.float().t())
            got = make_fp8_linear(lin)(x).float()
        out[case] = round(float((got - ref).norm() / ref.norm()), 5)
    return out


# first match wins: cuDNN's attention kernels have "fprop" in their names as its convolutions do
KINDS = (("fp8 GEMM (ours)", ("_fp8_gemm",)), ("fp8 quantize (ours)", ("_quantize_rows",)),
         ("attention", ("sdpa", "flash", "fmha", "attention", "attn")),
         ("convolution", ("fprop", "conv", "implicit_convolve", "winograd")),
         ("GEMM (cuBLAS)", ("gemm", "nvjet", "cutlass", "gemv", "sm90_xmma")),
         ("norms, GEGLU (ours)", ("_gn_", "group_norm", "layer_norm", "_geglu")))


def kind_of(kernel):
    name = kernel.lower()
    return next((kind for kind, marks in KINDS if any(m in name for m in marks)), "other (elementwise, copies)")


def profile_kinds(tag, model, clip, vae, size, batch):
    """GPU ms per image by kind of kernel, ours fp16 vs ours fp8, printed; {variant: {kind: ms}}."""
    out = {}
    for variant, accel in (("fp16", None), ("fp8", {"precision": "fp8"})):
        times, _ = cb.cuda_kernel_times(ENV, lambda: cb.run_graph(ENV, model, clip, vae, size, batch, 9, "ours",
                                                                   OPT.steps, accel=accel))
        kinds = {}
        for k, ms in times.items():
            kinds[kind_of(k)] = kinds.get(kind_of(k), 0.0) + ms
        out[variant] = kinds
        for k, ms in times.most_common(12):     # the largest, so a kernel put under the wrong kind shows
            cb.say("  %s %8.2f ms  %-20s %s" % (variant, ms, kind_of(k)[:20], k[:90]))
    total = {v: sum(k.values()) for v, k in out.items()}
    cb.say("PROFILE %s: GPU ms per image of %d steps, fp16 | fp8 (share of fp16's)" % (tag, OPT.steps))
    for kind in sorted(set(out["fp16"]) | set(out["fp8"]), key=lambda k: -out["fp16"].get(k, 0.0)):
        a, b = out["fp16"].get(kind, 0.0), out["fp8"].get(kind, 0.0)
        cb.say("  %-28s %9.2f %9.2f  (%4.1f%%)" % (kind, a, b, 100.0 * a / max(total["fp16"], 1e-9)))
    cb.say("  %-28s %9.2f %9.2f" % ("total", total["fp16"], total["fp8"]))
    return out


def main():
    env = cb.versions(ENV, OPT.comfy_dir)
    t0 = time.time()
    rows = []
    cb.say("per-layer FP8 rel. error vs fp32:", layer_errors())
    for tag in OPT.configs.split(","):
        if time.time() - t0 > OPT.deadline:
            cb.say("deadline: %s skipped" % tag)
            continue
        kind, size, batch = GEOM[tag]
        size = 64 if OPT.smoke else size
        model, clip, vae = cb.load_family(ENV, OPT, kind, LOADED)
        stock = measure(model, clip, vae, size, batch, "stock")
        fp16 = measure(model, clip, vae, size, batch, "ours")
        fp8 = measure(model, clip, vae, size, batch, "ours", accel={"precision": "fp8"})
        rec = cb.pair_record(env, OPT, tag + "_fp8", stock, fp8)
        rec.update(precision="fp8", ours_fp16_its=round(fp16["its"], 2),
                   speedup_vs_fp16=round(fp8["its"] / fp16["its"], 3), ours_fp16_peak_gib=round(fp16["peak_gib"], 3),
                   psnr_db=round(cb.psnr(fp8["img"], fp16["img"]), 2), unet_rel_err=round(unet_fp8_rel_err(
                       model, size, batch), 5), notes="; ".join(fp8["report"]["notes"] + ["%s: %s" % kv for kv in
                                                                                      fp8["report"]["fell_back"].items()]))
        rows.append(rec)
        cb.append_record(OPT, rec)
        if OPT.profile:
            profile_kinds(tag, model, clip, vae, size, batch)
    cb.say("%-16s %8s %8s %8s %8s %9s %8s" % ("config", "stock", "fp16", "fp8", "x_fp16", "rel_err", "psnr"))
    for r in rows:
        cb.say("%-16s %8.2f %8.2f %8.2f %8.3f %9.5f %8.2f" % (r["config"], r["stock_its"], r["ours_fp16_its"],
                                                             r["ours_its"], r["speedup_vs_fp16"], r["unet_rel_err"],
                                                             r["psnr_db"]))


if __name__ == "__main__":
    main()
