#!/usr/bin/env python3
"""Where CUDA graphs do not run: stock KSampler vs Accelerated KSampler, many alternations in one process.

A step without graphs is bound by the host at SD1.5 512² b1, and a host's speed moves a few percent from run to
run, so a 3-run median cannot tell a 2% difference. Per family (SD1.5 512² b1; SDXL 1024² b1 with --families), two
pairs on one loaded model, 20 steps euler, the same seed for every variant of a rep:
  * `eager_<family>`: stock KSampler vs ours with cuda_graph off (the plain model);
  * `eager_refused_<family>`: both on a clone with dev/patch_nodes.py's capture-breaking patch, ours with its
    defaults (its capture fails once, then every call of that key is refused and runs eagerly).
  * with --patches (dev/patch_nodes.py cases, e.g. LazyCache,EasyCache): `eager_<case>_<family>`, stock vs ours
    with cuda_graph off, both on a clone with that patch node applied.
  * with --controlnet: `eager_cn1_<family>`, stock vs ours with cuda_graph off, both with one random ControlNet of
    the family (Apply ControlNet, strength 1): ours' ControlNet calls take the eager path too.
Two warm-up runs of each variant, then --reps reps, the four variants in a rotated order each rep. Each record:
medians (`stock_its`, `ours_its`, `speedup` of the medians), the per-rep paired ratios' median and range
(`paired_ratio_*`: ours / stock of the same rep), and PSNR of ours' image against stock's.

  python3 bench/bench_eager.py --comfy-dir vendor/ComfyUI --out $OUT --reps 12
  python3 bench/bench_eager.py --smoke --steps 2 --reps 2 --out /tmp/bench_eager   (CPU plumbing check)
"""
import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap, deadline=400.0)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--families", default="sd15", help="comma-separated: sd15, sdxl")
ap.add_argument("--patches", default="", help="comma-separated dev/patch_nodes.py cases to pair too (eager_<case>)")
ap.add_argument("--controlnet", action="store_true", help="also the pair with one ControlNet (eager_cn1_<family>)")
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints", "controlnet"))
sys.path.insert(0, os.path.join(cb.REPO, "dev"))
import patch_nodes  # noqa: E402
SIZE = {"sd15": 512, "sdxl": 1024}


def variants(family, loaded):
    model, clip, vae = cb.load_family(ENV, OPT, family, loaded)
    broken = patch_nodes.add_capture_breaking_patch(model)
    pairs = {"eager_%s" % family: (("stock", model, None), ("ours", model, {"cuda_graph": False})),
             "eager_refused_%s" % family: (("stock", broken, None), ("ours", broken, None))}
    for case in filter(None, (c.strip() for c in OPT.patches.split(","))):
        if case == "HypernetworkLoader":
            patch_nodes.provide_hypernetwork(os.path.join(OPT.work, "hypernetworks"))
        patched = patch_nodes.apply_case(model, patch_nodes.cases(64 if OPT.smoke else SIZE[family])[case])
        pairs["eager_%s_%s" % (case.lower(), family)] = (("stock", patched, None),
                                                         ("ours", patched, {"cuda_graph": False}))
    if OPT.controlnet:
        add = with_controlnet(family)
        pairs["eager_cn1_%s" % family] = (("stock", model, None, add), ("ours", model, {"cuda_graph": False}, add))
    return pairs, clip, vae


def with_controlnet(family):
    """add_to_conds for comfy_bench.run_graph: one random ControlNet of `family` on both conds."""
    cn = cb.random_controlnet(ENV, OPT, family, "tiny" if OPT.smoke else "sd15")
    size = 64 if OPT.smoke else SIZE[family]
    hint = ENV.torch.rand((1, size, size, 3), generator=ENV.torch.Generator().manual_seed(3))

    def add(pos, neg):
        return ENV.nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, cn, hint, 1.0, 0.0, 1.0)[:2]
    return add


def run(variant, clip, vae, family, seed):
    sampler, model, accel = variant[:3]
    add = variant[3] if len(variant) > 3 else None
    size = 64 if OPT.smoke else SIZE[family]
    return cb.run_graph(ENV, model, clip, vae, size, 1, seed, sampler, OPT.steps, add, accel=accel)


def bench_family(family, loaded):
    pairs, clip, vae = variants(family, loaded)
    order = [(tag, side) for tag in pairs for side in (0, 1)]
    for seed in (1, 2):
        for tag, side in order:
            run(pairs[tag][side], clip, vae, family, seed)
    times = {k: [] for k in order}
    images, reports, lines = {}, {}, {}
    for rep in range(OPT.reps):
        if time.time() - cb.T0 > OPT.deadline:
            cb.say("DEADLINE", family, "after %d reps" % rep)
            break
        shift = rep % len(order)
        for tag, side in order[shift:] + order[:shift]:
            out = run(pairs[tag][side], clip, vae, family, 100 + rep)
            times[(tag, side)].append(out["sample_s"])
            images.setdefault((tag, side), out["img"])
            reports[(tag, side)] = out["report"]
            lines[(tag, side)] = out["line"] or ""
    env_info = cb.versions(ENV, OPT.comfy_dir)
    for tag in pairs:
        stock, ours = times[(tag, 0)], times[(tag, 1)]
        if not stock:
            continue
        ratios = sorted(s / o for s, o in zip(stock, ours))
        graphs = ((reports[(tag, 1)] or {}).get("graphs") or {})
        rec = dict(env_info, date=datetime.date.today().isoformat(), config="%s_%d_b1" % (tag, SIZE[family]),
                   steps=OPT.steps, sampler="euler", scheduler="normal", cfg=7.0, reps=len(stock),
                   stock_its=round(OPT.steps / statistics.median(stock), 2),
                   ours_its=round(OPT.steps / statistics.median(ours), 2),
                   paired_ratio_median=round(statistics.median(ratios), 3), paired_ratio_min=round(ratios[0], 3),
                   paired_ratio_max=round(ratios[-1], 3),
                   psnr_db=round(cb.psnr(images[(tag, 0)], images[(tag, 1)]), 2),
                   notes="eager paths chosen: %s; stock-path calls %s; refused: %s; replays %s" % (
                       graphs.get("eager_paths"), graphs.get("stock_path"), graphs.get("refused"),
                       graphs.get("replays")) + "".join(
                           "; " + p.strip() for p in lines[(tag, 1)].split(" | ") if p.strip().startswith("controlnet")))
        rec["speedup"] = round(rec["ours_its"] / rec["stock_its"], 3)
        cb.append_record(OPT, rec)


def main():
    loaded = {}
    for family in OPT.families.split(","):
        bench_family(family.strip(), loaded)


if __name__ == "__main__":
    main()
