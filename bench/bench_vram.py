#!/usr/bin/env python3
"""VRAM Pool under a budget vs stock ComfyUI fully resident (vs ComfyUI's own low-VRAM loading held to the
same budget), side by side in one process, same seeds.

GPU machine only (--smoke: a CPU plumbing check). ComfyUI's own nodes in-process (comfy_bench's boot):
CheckpointLoaderSimple -> CLIPTextEncode x2 -> EmptyLatentImage -> KSampler -> VAEDecode on random full-size
checkpoints. Per config three variants of the model fed to the same KSampler:
  stock        the model as loaded, fully resident, ComfyUI's KSampler (the baseline of ratio_vs_full),
  ours         SDAccelVRAMPool(budget, offload=lowvram) + Accelerated KSampler with its defaults: partial load
               + block streaming into a fixed GPU ring with prefetch, the copies replayed in the step's CUDA
               graph with the fused kernels,
  ours_ksampler (optional) the same pool with ComfyUI's own KSampler: the streaming alone, eager,
  comfy_lowvram SDAccelVRAMPool(budget, offload=none): only ComfyUI's partial loading held to the budget
               (what --lowvram --reserve-vram does), for speedup_vs_comfy_lowvram.
Peak = torch.cuda.max_memory_allocated over the sampling call. Host memory after a variant's runs: the UNet's
weights held on the host (its tensors' storages and the pool's pinned buffers, each once; `unet_host_gib`,
against `unet_weights_gib` in all), the page-locked total (`pinned_gib`) and the process's RSS. Appends one JSON line per config (fields of
../shared/BENCH.md) to $OUT/results.jsonl and prints a table.

  python3 bench/bench_vram.py --comfy-dir vendor/ComfyUI --out $OUT [--configs sd15_512_b1_budget1,...]
  python3 bench/bench_vram.py --smoke          # CPU: tiny models, 64 px, 2 steps
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

CONFIGS = {"sd15_512_b1_budget1": ("sd15", 512, 1, 1.0), "sdxl_1024_b1_budget4": ("sdxl", 1024, 1, 4.0),
           "sdxl_1024_b1_budget2": ("sdxl", 1024, 1, 2.0)}

ap = argparse.ArgumentParser()
cb.add_common_args(ap)
ap.add_argument("--configs", default=",".join(CONFIGS))
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--variants", default="stock,ours,comfy_lowvram")
ap.add_argument("--stock-twice", action="store_true",
                help="measure stock again after ours; ratio_vs_full against the faster stock run")
OPT = ap.parse_args()
if OPT.smoke:
    OPT.steps = min(OPT.steps, 2)
    OPT.reps = min(OPT.reps, 1)
    if OPT.configs == ",".join(CONFIGS):
        OPT.configs = "sd15_512_b1_budget1"     # a full-size SDXL is too much for a CPU check
ENV = cb.boot(OPT, ("checkpoints",))
torch, nodes, mm, fixtures = ENV.torch, ENV.nodes, ENV.mm, ENV.fixtures
say, psnr = cb.say, cb.psnr
LOADED = {}


def load(kind):
    return cb.load_family(ENV, OPT, kind, LOADED)


def pool_model(model, budget, offload):
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    from sd_accel.hosts.comfyui.memory import pool_settings
    res = SDAccelVRAMPool().apply(model, budget_gib=budget, offload=offload)
    clone = res["result"][0]
    settings = pool_settings(clone)
    if OPT.smoke and offload == "lowvram":
        settings.stream_every_block = True     # the CPU check runs the streamer with real copies
    return clone, settings, res["ui"]["text"][0]


def measure(model, clip, vae, size, batch, settings=None, sampler="stock"):
    mm.unload_all_models()               # every variant loads the UNet itself, under its own rules
    mm.soft_empty_cache()
    run = lambda seed: cb.run_graph(ENV, model, clip, vae, size, batch, seed, sampler, OPT.steps)  # noqa: E731
    first = run(1)
    runs = []
    for r in range(OPT.reps):
        runs.append(run(100 + r))
    med = lambda k: statistics.median(x[k] for x in runs)  # noqa: E731
    out = {"its": OPT.steps / med("sample_s"), "sample_s": med("sample_s"), "e2e_s": med("e2e_s"),
           "peak_gib": max(x["peak_gib"] for x in runs), "first_s": first["sample_s"], "img": runs[0]["img"]}
    out["host"] = cb.host_memory(ENV, model, () if settings is None else (settings.pinned_cache,
                                                                          settings.promoted_cache))
    if settings is not None:
        out["notes"] = "; ".join(settings.last_notes)
        out["report"] = settings.last_report
    if runs[-1]["line"]:
        out["notes"] = out.get("notes", "") + " | Accelerated KSampler: " + runs[-1]["line"]
    return out


def main():
    env = cb.versions(ENV, OPT.comfy_dir)
    say("ENV", json.dumps(env), "allocator:", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    variants = OPT.variants.split(",")
    rows = []
    for tag in OPT.configs.split(","):
        if time.time() - cb.T0 > OPT.deadline:
            say("SKIP", tag, "past the deadline")
            continue
        kind, size, batch, budget = CONFIGS[tag]
        if OPT.smoke:
            size, budget = 64, 8.0       # the CPU check: tiny model, no real cap
        try:
            model, clip, vae = load(kind)
            rec = dict(env, date=datetime.date.today().isoformat(), config=tag, steps=OPT.steps, sampler="euler",
                       scheduler="normal", cfg=7.0, budget_gib=budget)
            stock = measure(model, clip, vae, size, batch)
            rec.update(stock_its=round(stock["its"], 2), stock_peak_gib=round(stock["peak_gib"], 3),
                       stock_e2e_s=round(stock["e2e_s"], 3),
                       stock_unet_host_gib=round(stock["host"]["unet_host"], 3),
                       unet_weights_gib=round(sum(t.numel() * t.element_size() for t in
                                                  model.model.diffusion_model.parameters()) / 2 ** 30, 3))
            say("stock", tag, "%.2f it/s, peak %.2f GiB" % (stock["its"], stock["peak_gib"]))
            if OPT.stock_twice:
                # stock's it/s moved by up to 1.5x between configs of one process (device run 26): measured
                # again after ours, and the ratio taken against the faster of the two (the stricter ratio)
                stock_before = stock["its"]
            notes = []
            for variant, sampler in (("ours", "ours"), ("ours_ksampler", "stock")):
                if variant not in variants:
                    continue
                pm, settings, line = pool_model(model, budget, "lowvram")
                say("plan", line)
                ours = measure(pm, clip, vae, size, batch, settings, sampler)
                fields = dict(its=round(ours["its"], 2), peak_gib=round(ours["peak_gib"], 3),
                              e2e_s=round(ours["e2e_s"], 3), ratio_vs_full=round(ours["its"] / stock["its"], 3),
                              psnr_db=round(psnr(stock["img"], ours["img"]), 2),
                              within_budget=bool(ours["peak_gib"] <= budget) if ENV.cuda else None)
                # host memory held for the UNet's weights after the run (the model's host copies plus the
                # pool's pinned buffers, each storage once), the page-locked total and the process's RSS
                fields.update(unet_host_gib=round(ours["host"]["unet_host"], 3),
                              pinned_gib=round(ours["host"]["pinned"], 3), rss_gib=round(ours["host"]["rss"], 3))
                if variant == "ours":
                    rec.update({("ours_" + k if k in ("its", "peak_gib", "e2e_s", "unet_host_gib", "pinned_gib",
                                                      "rss_gib") else k): v
                                for k, v in fields.items()},
                               first_run_s=round(ours["first_s"] - ours["sample_s"], 2))
                else:
                    rec.update({"ours_ksampler_" + k: v for k, v in fields.items()})
                notes.append("%s: %s" % (variant, ours["notes"]))
                say(variant, tag, "%.2f it/s, peak %.2f GiB | %s" % (ours["its"], ours["peak_gib"], ours["notes"]))
                del pm
            if OPT.stock_twice:
                again = measure(model, clip, vae, size, batch)
                rec.update(stock_its_before=round(stock_before, 2), stock_its_after=round(again["its"], 2))
                best = max(stock_before, again["its"])
                rec["stock_its"] = round(best, 2)
                for k, its in (("ratio_vs_full", rec.get("ours_its")), ("ours_ksampler_ratio_vs_full",
                                                                        rec.get("ours_ksampler_its"))):
                    if its is not None:
                        rec[k] = round(its / best, 3)
                say("stock again", tag, "%.2f it/s (before ours: %.2f)" % (again["its"], stock_before))
            if "comfy_lowvram" in variants and time.time() - cb.T0 < OPT.deadline - 60:
                cm, settings, _ = pool_model(model, budget, "none")
                low = measure(cm, clip, vae, size, batch, settings)
                rec.update(comfy_lowvram_its=round(low["its"], 2), comfy_lowvram_peak_gib=round(low["peak_gib"], 3),
                           comfy_lowvram_psnr_db=round(psnr(stock["img"], low["img"]), 2))
                if "ours_its" in rec:
                    rec["speedup_vs_comfy_lowvram"] = round(rec["ours_its"] / low["its"], 3)
                notes.append("comfy_lowvram (ComfyUI's partial loading held to the budget through the pool, "
                             "offload=none): " + low["notes"])
                say("comfy_lowvram", tag, "%.2f it/s, peak %.2f GiB" % (low["its"], low["peak_gib"]))
                del cm
            rec["notes"] = " | ".join(notes)
            rows.append(rec)
            cb.append_record(OPT, rec)
        except Exception:  # noqa: BLE001 - keep the other configs
            say("ERROR", tag, traceback.format_exc())
    print("%-22s %6s %9s %9s %7s %9s %7s %8s %8s %8s %7s %8s %8s" % (
        "config", "budget", "stock it/s", "ours it/s", "ratio", "comfy_lv", "x lv", "peak st", "peak us",
        "peak lv", "PSNR", "host us", "pinned"))
    for r in rows:
        print("%-22s %6.1f %9.2f %9s %7s %9s %7s %8.2f %8s %8s %7s %8s %8s" % (
            r["config"], r["budget_gib"], r["stock_its"], r.get("ours_its", "-"), r.get("ratio_vs_full", "-"),
            r.get("comfy_lowvram_its", "-"), r.get("speedup_vs_comfy_lowvram", "-"), r["stock_peak_gib"],
            r.get("ours_peak_gib", "-"), r.get("comfy_lowvram_peak_gib", "-"), r.get("psnr_db", "-"),
            r.get("ours_unet_host_gib", "-"), r.get("ours_pinned_gib", "-")))


if __name__ == "__main__":
    main()
