#!/usr/bin/env python3
"""Text encode: ComfyUI's CLIP Text Encode on the checkpoint's CLIP vs on Apply SD Accel (CLIP)'s copy, one process.

Per family (SD1.5's CLIP-L; SDXL's CLIP-L + CLIP-G) and prompt kind, alternating stock and ours with a new text
per call (ComfyUI caches a repeated text's encode, so a user's changed prompt is what costs): `plain` (one
77-token chunk), `weighted` (a "(word:1.2)" weight: ComfyUI encodes an empty chunk beside it), `long` (three
chunks), `clip_skip` (CLIP Set Last Layer -2; SDXL's encoders already take a hidden layer, so SD1.5 only). Each
call's time is the node's, with the GPU synchronised after it (ComfyUI hands the conditioning on in host
memory, so its encode waits for the GPU anyway). Records `text_encode_<family>_<kind>`: medians of --reps pairs
in ms, their ratio, and whether ours' conditioning (cond and pooled output) equals stock's bit for bit; the
graphs' captures and replays, and the driver's graph memory after the family's calls.

  python3 bench/bench_text_encode.py --comfy-dir vendor/ComfyUI --out $OUT
  python3 bench/bench_text_encode.py --smoke --reps 2 --out /tmp/bench_text   (CPU plumbing check: no graphs)
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap, deadline=200.0)
ap.add_argument("--families", default="sd15,sdxl", help="comma-separated: sd15, sdxl")
ap.set_defaults(reps=15)
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
KINDS = {"plain": "{}", "weighted": "a photograph of an (astronaut:1.2) riding a horse, {}",
         "long": ", ".join(["a very detailed photograph of an astronaut riding a horse on the moon"] * 12) + ", {}",
         "clip_skip": "{}"}


def prompt(kind, k):
    return KINDS[kind].format("%s, study %d" % (cb.POS, k))


def encode(clip, text):
    torch = ENV.torch
    with torch.inference_mode():
        cb.sync(ENV)
        t0 = time.perf_counter()
        cond = ENV.nodes.CLIPTextEncode().encode(clip, text)[0]
        cb.sync(ENV)
        return time.perf_counter() - t0, cond


def same(a, b):
    torch = ENV.torch
    (ca, da), (cb_, db) = a[0], b[0]
    pa, pb = da.get("pooled_output"), db.get("pooled_output")
    return bool(torch.equal(ca, cb_) and ((pa is None and pb is None) or torch.equal(pa, pb)))


def graph_counts(info):
    """{encoder: its StepGraphs' counters, with the reasons its eager calls had}."""
    return {name: dict(gf.graphs.stats, refused=dict(gf.graphs.refused)) for name, gf in info["forwards"].items()}


def bench_kind(family, kind, stock_clip, ours_clip, info, k0):
    from sd_accel.hosts.comfyui import clip_accel
    if kind == "clip_skip":
        stock_clip = ENV.nodes.CLIPSetLastLayer().set_last_layer(stock_clip, -2)[0]
        ours_clip = ENV.nodes.CLIPSetLastLayer().set_last_layer(ours_clip, -2)[0]
    before = graph_counts(info)
    for k in range(3):   # warm-up: ours' first calls of a new length probe and capture
        encode(stock_clip, prompt(kind, k0 + k))
        encode(ours_clip, prompt(kind, k0 + k))
    times = {"stock": [], "ours": []}
    exact = True
    for k in range(OPT.reps):
        text = prompt(kind, k0 + 100 + k)
        order = ("stock", "ours") if k % 2 == 0 else ("ours", "stock")
        conds = {}
        for side in order:
            dt, conds[side] = encode(stock_clip if side == "stock" else ours_clip, text)
            times[side].append(dt * 1e3)
        exact = exact and same(conds["stock"], conds["ours"])
    after = graph_counts(info)
    graphs = {n: {s: after[n][s] - before.get(n, {}).get(s, 0) for s in ("captures", "replays", "eager")}
              for n in after}
    stock_ms, ours_ms = statistics.median(times["stock"]), statistics.median(times["ours"])
    rec = dict(cb.versions(ENV, OPT.comfy_dir), date=time.strftime("%Y-%m-%d"),
               config="text_encode_%s_%s" % (family, kind), stock_ms=round(stock_ms, 2), ours_ms=round(ours_ms, 2),
               speedup=round(stock_ms / ours_ms, 3), exact=exact, reps=OPT.reps,
               stock_ms_range=[round(min(times["stock"]), 2), round(max(times["stock"]), 2)],
               ours_ms_range=[round(min(times["ours"]), 2), round(max(times["ours"]), 2)],
               graphs=graphs, refused={n: after[n]["refused"] for n in after if after[n]["refused"]},
               notes="CLIPTextEncode on the checkpoint's CLIP vs on Apply SD Accel (CLIP)'s copy, alternating, a new "
                     "text per call; %s" % clip_accel.patched_line(info))
    cb.append_record(OPT, rec)
    return rec


def main():
    from sd_accel.hosts.comfyui import clip_accel
    loaded, recs = {}, []
    for family in OPT.families.split(","):
        if time.time() - cb.T0 > OPT.deadline:
            cb.say("deadline: %s skipped" % family)
            continue
        _, clip, _ = cb.load_family(ENV, OPT, family, loaded)
        ours, info = clip_accel.accelerate_clip(clip)
        cb.say(family, clip_accel.patched_line(info))
        kinds = [k for k in KINDS if not (k == "clip_skip" and family == "sdxl")]
        for i, kind in enumerate(kinds):
            recs.append(bench_kind(family, kind, clip, ours, info, 1000 * i))
        mem = cb.graph_mem_bytes(ENV.cuda)
        cb.say("%s: driver graph memory after its calls: %s"
               % (family, "n/a" if mem is None else "%.1f MiB" % (mem / 2**20)))
    cb.say("%-32s %9s %9s %7s %6s %s" % ("config", "stock ms", "ours ms", "x", "exact", "graphs"))
    for r in recs:
        cb.say("%-32s %9.2f %9.2f %7.2f %6s %s" % (r["config"], r["stock_ms"], r["ours_ms"], r["speedup"], r["exact"],
                                                 r["graphs"]))


if __name__ == "__main__":
    main()
