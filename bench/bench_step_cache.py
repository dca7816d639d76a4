#!/usr/bin/env python3
"""The step cache (DeepCache, LOSSY) against stock and against our lossless fp16 path, in one process, same seeds.

Per geometry (SD1.5 512² b1 and b4, SDXL 1024² b1; 20 steps, euler, normal, CFG 7) it runs the whole graph
(text encode -> sampler -> VAE decode) with: stock KSampler; Accelerated KSampler with its defaults (fp16,
lossless); and Accelerated KSampler with step_cache on, one run per mode in --modes. For each accelerated
variant one record (../shared/BENCH.md fields) goes to $OUT/results.jsonl as config `stepcache_<geometry>_<mode>`
(`lossless` for the defaults): it/s and s/image, speedup over stock, final-image PSNR against stock and against
our lossless image (`psnr_vs_fp16_db`), the latent's relative L2 error against our lossless latent, and what
the run report said (how many steps ran cached, graph captures and replays per run). Random full-size weights:
the speed is real, the PSNR says how far the image moves on random weights only, never on a trained model.

  python3 bench/bench_step_cache.py --comfy-dir vendor/ComfyUI --out $OUT [--configs sd15_512_b1,...]
  python3 bench/bench_step_cache.py --smoke          # CPU plumbing check: tiny SD1.5 UNet, 64 px, 4 steps
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

GEOM = {"sd15_512_b1": ("sd15", 512, 1), "sd15_512_b4": ("sd15", 512, 4), "sdxl_1024_b1": ("sdxl", 1024, 1)}
ap = argparse.ArgumentParser()
cb.add_common_args(ap, deadline=280.0)
ap.add_argument("--configs", default=None, help="comma list of %s (default: all; --smoke: sd15_512_b1)" % ", ".join(GEOM))
ap.add_argument("--modes", default="interval 2,interval 3,non-uniform 3", help="step_cache modes, comma list")
ap.add_argument("--branch", type=int, default=0, help="step_cache_branch of every step-cache run")
ap.add_argument("--steps", type=int, default=None, help="default 20 (--smoke: 4)")
OPT = ap.parse_args()
OPT.steps = OPT.steps or (4 if OPT.smoke else 20)
if OPT.smoke:
    OPT.reps = min(OPT.reps, 1)
OPT.configs = OPT.configs or ("sd15_512_b1" if OPT.smoke else ",".join(GEOM))
ENV = cb.boot(OPT, ("checkpoints",))
say, psnr = cb.say, cb.psnr
LOADED = {}


def measure(model, clip, vae, size, batch, sampler, accel=None):
    """A warm-up run (first run: captures, tuning), then --reps timed runs with seeds 100, 101, ..."""
    run = lambda seed: cb.run_graph(ENV, model, clip, vae, size, batch, seed, sampler, OPT.steps,  # noqa: E731
                                    accel=accel)
    first = run(1)
    runs = [run(100 + r) for r in range(OPT.reps)]
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    return {"its": OPT.steps / med("sample_s"), "sample_s": med("sample_s"), "e2e_s": med("e2e_s"),
            "s_per_image": med("e2e_s") / batch, "peak_gib": max(r["peak_gib"] for r in runs),
            "first_s": first["sample_s"], "img": runs[0]["img"], "latent": runs[0]["latent"],
            "report": runs[-1]["report"] or {}, "line": runs[-1]["line"]}


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def record(env, tag, mode, stock, lossless, ours):
    rec = cb.pair_record(env, OPT, "stepcache_%s_%s" % (tag, mode.replace(" ", "").replace("-", "")),
                         stock, ours)
    rep = ours["report"]
    graphs = rep.get("graphs") or {}
    rec.update(precision="fp16", step_cache=mode if mode != "lossless" else "off",
               step_cache_branch=OPT.branch if mode != "lossless" else None,
               stock_s_per_image=round(stock["s_per_image"], 4), ours_s_per_image=round(ours["s_per_image"], 4),
               psnr_vs_fp16_db=round(psnr(lossless["img"], ours["img"]), 2),
               latent_rel_err_vs_fp16=rel_err(ours["latent"], lossless["latent"]),
               latent_rel_err_vs_stock=rel_err(ours["latent"], stock["latent"]),
               graphs=bool(graphs.get("replays")), step_cache_summary=rep.get("step_cache"),
               # each kind of call replays its own graph: a warm run with both kinds has no eager call
               every_call_replayed=bool(graphs.get("replays")) and not graphs.get("eager"),
               notes="ran: %s; fell back: %s; graphs: %s" % (", ".join(rep.get("ran", [])),
                                                            json.dumps(rep.get("fell_back", {})),
                                                            json.dumps(rep.get("graphs"))))
    if mode != "lossless":
        rec["speedup_vs_fp16"] = round(ours["its"] / lossless["its"], 3)
        rec["notes"] = "LOSSY (step_cache %s, random weights: the PSNR says nothing of a trained model); %s" % (
            mode, rec["notes"])
    return rec


def run_geometry(env, tag):
    kind, size, batch = GEOM[tag]
    if OPT.smoke:
        if kind == "sdxl":
            say("SKIP", tag, "--smoke builds only the tiny SD1.5 preset")
            return []
        size = 64
    model, clip, vae = cb.load_family(ENV, OPT, kind, LOADED)
    stock = measure(model, clip, vae, size, batch, "stock")
    lossless = measure(model, clip, vae, size, batch, "ours")
    rows = [record(env, tag, "lossless", stock, lossless, lossless)]
    cb.append_record(OPT, rows[-1])
    for mode in filter(None, (m.strip() for m in OPT.modes.split(","))):
        if time.time() - cb.T0 > OPT.deadline:
            say("SKIP", tag, mode, "past the deadline")
            continue
        ours = measure(model, clip, vae, size, batch, "ours",
                       accel={"step_cache": mode, "step_cache_branch": OPT.branch})
        say("REPORT", tag, mode, ours["line"])
        rows.append(record(env, tag, mode, stock, lossless, ours))
        cb.append_record(OPT, rows[-1])
    return rows


def main():
    env = cb.versions(ENV, OPT.comfy_dir)
    say("ENV", json.dumps(env))
    rows = []
    for tag in OPT.configs.split(","):
        if time.time() - cb.T0 > OPT.deadline:
            say("SKIP", tag, "past the deadline")
            continue
        try:
            rows += run_geometry(env, tag)
        except Exception:  # noqa: BLE001 - keep the other geometries
            say("ERROR", tag, traceback.format_exc())
    print("%-38s %9s %9s %7s %8s %9s %9s %9s %9s %8s" % (
        "config", "stock it/s", "ours it/s", "x stock", "x fp16", "s/img st", "s/img us", "PSNR st", "PSNR fp16",
        "lat err"))
    for r in rows:
        print("%-38s %9.2f %9.2f %7.2f %8s %9.3f %9.3f %9.2f %9.2f %8.2e" % (
            r["config"], r["stock_its"], r["ours_its"], r["speedup"], r.get("speedup_vs_fp16", "-"),
            r["stock_s_per_image"], r["ours_s_per_image"], r["psnr_db"], r["psnr_vs_fp16_db"],
            r["latent_rel_err_vs_fp16"]))


if __name__ == "__main__":
    main()
