#!/usr/bin/env python3
"""Stock KSampler vs Accelerated KSampler under ComfyUI's own model patch nodes, in one process, same seeds.

GPU machine (`--smoke`: a CPU plumbing check, tiny SD1.5 UNet, 64 px, 3 steps). Per patch node of
dev/patch_nodes.py's table on SD1.5 512² (FreeU_V2, PerturbedAttentionGuidance and EasyCache also on SDXL
1024²): the patched model through KSampler, through the Accelerated KSampler (its defaults) and through it with
cuda_graph off (`ours_eager_its`), after a warm-up of each, then alternating run by run (ABAB: host variance),
median of --reps timed runs; whether the graphs replayed and, where not, what the report says was refused;
PSNR of the decoded image against stock's with the same patch and seed. ComfyUI is booted in main.py's order
(comfy_bench.boot: its default cudaMallocAsync allocator) on random full-size checkpoints built here.

Two passes: `fresh`, every config in order (SDXL, then SD1.5 with the patches the issue saw abort or break later
captures last; each record's notes list the configs before it that replayed no graph), and `after_refused`: a patch
whose capture fails runs first (dev/patch_nodes.py's capture-breaking patch, and EasyCache with `--refuse-first
uncapturable,easycache`; records `patch_uncapturable` / `patch_easycache_first`), then the SD1.5 configs, named
`<config>_after_refused`: stock's it/s and ours must not change. `--passes fresh,after_refused` runs both in one
process; gpu_battery.sh runs each in a process of its own (parts `patches` and `patches_after_refused`), so that
each stays within its time and the second starts with the refused capture. One JSON line per
config (fields of ../shared/BENCH.md, plus `graphs_refused`: what the report said where no graph replayed, and
`eager_psnr_db`) to $OUT/results.jsonl, a table last.

  python3 bench/bench_patches.py --comfy-dir vendor/ComfyUI --out $OUT [--configs patch_freeu_v2,...]
  python3 bench/bench_patches.py --smoke --out /tmp/bench_patches
"""
import argparse
import json
import logging
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

SDXL_NODES = ("FreeU_V2", "PerturbedAttentionGuidance", "EasyCache")
# the issue saw these abort the process or break later captures: measured last in a pass, so that if one still
# does, the records already written cover the others
RISKY = ("EasyCache", "LazyCache", "PatchModelAddDownscale")
FAMILY_SIZE = {"sd15": 512, "sdxl": 1024}
VARIANTS = {"stock": ("stock", None), "ours": ("ours", None), "eager": ("ours", {"cuda_graph": False})}


def config_table(patch_nodes):
    """{config: (family, case id)} in the order measured: SDXL (EasyCache last), then SD1.5 with the risky ones
    last but for the fp8 UNet, a second model beside the fp16 one (ComfyUI can then load the fp16 model partially,
    and the configs after it run without graphs: it runs last and is released after)."""
    table = {"patch_%s_sdxl" % c.lower(): ("sdxl", c) for c in SDXL_NODES}
    sd15 = sorted(patch_nodes.cases(512), key=lambda c: (c == patch_nodes.FP8_UNET, c in RISKY))
    table.update({"patch_%s" % c.lower().replace(" ", "_"): ("sd15", c) for c in sd15})
    return table


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cb.add_common_args(ap, deadline=330.0)
    ap.add_argument("--configs", default="",
                    help="comma-separated; default: every config but dev/patch_nodes.py's LATER")
    ap.add_argument("--steps", type=int, default=None, help="default 20 (3 with --smoke)")
    ap.add_argument("--passes", default="fresh,after_refused")
    ap.add_argument("--refuse-first", default="uncapturable",
                    help="what runs before the after_refused pass: uncapturable and/or easycache")
    ap.add_argument("--no-eager", action="store_true", help="skip the cuda_graph-off variant")
    opt = ap.parse_args()
    if opt.steps is None:
        opt.steps = 3 if opt.smoke else 20
    return opt


OPT = parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
sys.path.insert(0, os.path.join(cb.REPO, "dev"))
import folder_paths  # noqa: E402
import patch_nodes  # noqa: E402
folder_paths.add_model_folder_path("diffusion_models", os.path.join(OPT.work, "checkpoints"))
say = cb.say
LOADED = {}
CONFIGS = config_table(patch_nodes)
REFUSED_SO_FAR = []   # configs of this process whose accelerated runs replayed no graph


class CacheLog(logging.Handler):
    """EasyCache / LazyCache log how many steps they skipped; kept for the notes, with the variant that ran.
    Also counts ComfyUI's "memory leak with model" warnings: a loaded model whose patchers are all gone while
    its weights live, after which every load runs a full garbage collection (stock's too)."""

    def __init__(self):
        super().__init__()
        self.lines = []
        self.variant = None
        self.leak_warnings = 0

    def emit(self, record):
        msg = record.getMessage()
        if " - skipped " in msg:
            self.lines.append("%s: %s" % (self.variant, msg))
        elif "memory leak with model" in msg:
            self.leak_warnings += 1


def size_of(family):
    return 64 if OPT.smoke else FAMILY_SIZE[family]


def patched_model(family, case):
    model, clip, vae = cb.load_family(ENV, OPT, family, LOADED)
    if case == patch_nodes.FP8_UNET:
        return patch_nodes.load_fp8_unet("random_%s_fp16.safetensors" % family), clip, vae
    if case == "uncapturable":
        return patch_nodes.add_capture_breaking_patch(model), clip, vae
    if case == "HypernetworkLoader":
        patch_nodes.provide_hypernetwork(os.path.join(OPT.work, "hypernetworks"))
    return patch_nodes.apply_case(model, patch_nodes.cases(size_of(family))[case]), clip, vae


def run(model, clip, vae, size, seed, variant):
    sampler, accel = VARIANTS[variant]
    return cb.run_graph(ENV, model, clip, vae, size, 1, seed, sampler, OPT.steps, accel=accel)


def summarize(first, runs):
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    return {"its": OPT.steps / med("sample_s"), "sample_s": med("sample_s"), "e2e_s": med("e2e_s"),
            "peak_gib": max(r["peak_gib"] for r in runs), "first_s": first["sample_s"], "img": runs[0]["img"],
            "report": runs[-1]["report"], "first_report": first["report"], "reports": [r["report"] for r in runs]}


def measure(model, clip, vae, size, variants, log):
    """A warm-up of each variant (seed 1), then the variants alternating, OPT.reps timed runs each (seeds 100, 101,
    ... the same for every variant)."""
    first, runs = {}, {v: [] for v in variants}
    for r in [None] + list(range(OPT.reps)):
        for v in variants:
            log.variant = v
            out = run(model, clip, vae, size, 1 if r is None else 100 + r, v)
            if r is None:
                first[v] = out
            else:
                runs[v].append(out)
    return {v: summarize(first[v], runs[v]) for v in variants}


def graphs_note(report):
    g = (report or {}).get("graphs") or {}
    return {"replays": g.get("replays", 0), "captures": g.get("captures", 0), "eager": g.get("eager", 0),
            "refused": g.get("refused"), "eager_reason": g.get("eager_reason")}


def record(tag, family, case, res, pass_name, cache_lines, leak_warnings):
    env_info = cb.versions(ENV, OPT.comfy_dir)
    rec = cb.pair_record(env_info, OPT, tag, res["stock"], res["ours"])
    ours_rep = res["ours"]["report"] or {}
    rec["graphs"] = any((r or {}).get("graphs", {}).get("replays", 0) > 0 for r in res["ours"]["reports"])
    if "eager" in res:   # the cuda_graph-off variant
        rec["ours_eager_its"] = round(res["eager"]["its"], 2)
        rec["eager_psnr_db"] = round(cb.psnr(res["stock"]["img"], res["eager"]["img"]), 2)
    elif not rec["graphs"]:
        rec["ours_eager_its"] = rec["ours_its"]   # graphs refused: the default runs themselves were eager
    note = graphs_note(ours_rep)
    rec["graphs_refused"] = None if rec["graphs"] else (note["refused"] or note["eager_reason"])
    nodes = [] if case in (patch_nodes.FP8_UNET, "uncapturable") else patch_nodes.cases(size_of(family))[case]
    rec["notes"] = ("pass %s (configs that replayed no graph earlier in this process: %s); nodes %s; ran: %s; "
                    "fell back: %s; graphs (last timed run): %s; first run: %s%s") % (
        pass_name, ", ".join(REFUSED_SO_FAR) or "none", json.dumps(nodes) if nodes else case,
        ", ".join(ours_rep.get("ran", [])), json.dumps(ours_rep.get("fell_back", {})), json.dumps(note),
        json.dumps(graphs_note(res["ours"]["first_report"])),
        "; cache: %s" % " | ".join(dict.fromkeys(cache_lines)) if cache_lines else "")
    rec["comfyui_leak_warnings"] = leak_warnings
    if not rec["graphs"]:
        REFUSED_SO_FAR.append(tag)
    nonfinite = {v: int((~res[v]["img"].isfinite()).sum()) for v in res}
    if any(nonfinite.values()):   # e.g. zero-SNR's huge latents overflow the fp16 VAE: no PSNR to give
        rec["psnr_db"] = None
        rec["notes"] += "; non-finite pixels in the decoded images: %s" % json.dumps(nonfinite)
    return rec


def bench_config(tag, family, case, pass_name, eager):
    model, clip, vae = patched_model(family, case)
    variants = ("stock", "ours", "eager") if eager else ("stock", "ours")
    log, root = CacheLog(), logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)   # the caches log at INFO; in-process nothing set the level up as main.py does
    root.addHandler(log)
    try:
        res = measure(model, clip, vae, size_of(family), variants, log)
    finally:
        root.removeHandler(log)
        root.setLevel(level)
    rec = record(tag, family, case, res, pass_name, log.lines, log.leak_warnings)
    cb.append_record(OPT, rec)
    if case == patch_nodes.FP8_UNET:   # the second UNet leaves: the next config's model loads whole again
        del model, res
        ENV.mm.unload_all_models()
        ENV.mm.soft_empty_cache()
    return rec


def past_deadline(tag):
    if time.time() - cb.T0 > OPT.deadline:
        say("SKIP", tag, "past the deadline")
        return True
    return False


def run_pass(configs, pass_name, suffix, eager, rows):
    for tag in configs:
        family, case = CONFIGS[tag]
        if past_deadline(tag + suffix):
            continue
        if OPT.smoke and family == "sdxl":
            say("SKIP", tag, "--smoke: no small SDXL fixture")
            continue
        try:
            rows.append(bench_config(tag + suffix, family, case, pass_name, eager))
        except Exception:  # noqa: BLE001 - keep the other configs
            say("ERROR", tag + suffix, traceback.format_exc())


def refuse_first(rows):
    """The patches whose capture fails, before the after_refused pass (on SD1.5: the model that pass reuses)."""
    for what in filter(None, OPT.refuse_first.split(",")):
        tag, case = {"uncapturable": ("patch_uncapturable", "uncapturable"),
                     "easycache": ("patch_easycache_first", "EasyCache")}[what]
        if past_deadline(tag):
            continue
        try:
            rows.append(bench_config(tag, "sd15", case, "refuse_first", eager=False))
        except Exception:  # noqa: BLE001
            say("ERROR", tag, traceback.format_exc())


def print_table(rows):
    print("%-54s %9s %9s %6s %9s %6s %6s %7s %5s  %s" % ("config", "stock it/s", "ours it/s", "x", "eager it/s",
                                                        "x", "graphs", "PSNR", "leaks", "refused"))
    for r in rows:
        eager = r.get("ours_eager_its")
        refused = json.dumps(r["graphs_refused"])[:80] if r["graphs_refused"] else ""
        print("%-54s %9.2f %9.2f %6.2f %9s %6s %6s %7s %5d  %s" % (
            r["config"], r["stock_its"], r["ours_its"], r["speedup"], "%.2f" % eager if eager else "-",
            "%.2f" % (eager / r["stock_its"]) if eager else "-", "yes" if r["graphs"] else "no",
            "%.1f" % r["psnr_db"] if r["psnr_db"] is not None else "n/a", r["comfyui_leak_warnings"], refused))


def main():
    say("ENV", json.dumps(cb.versions(ENV, OPT.comfy_dir)), "allocator:", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    wanted = [c for c in OPT.configs.split(",") if c] or [c for c in CONFIGS if CONFIGS[c][1] not in patch_nodes.LATER]
    unknown = [c for c in wanted if c not in CONFIGS]
    if unknown:
        sys.exit("unknown configs %s; known: %s" % (unknown, ", ".join(CONFIGS)))
    configs = [c for c in CONFIGS if c in wanted]   # the table's order (see config_table)
    rows = []
    passes = OPT.passes.split(",")
    if "fresh" in passes:
        run_pass(configs, "fresh", "", not OPT.no_eager, rows)
    if "after_refused" in passes:
        refuse_first(rows)
        run_pass([c for c in configs if CONFIGS[c][0] == "sd15"], "after_refused", "_after_refused", False, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
