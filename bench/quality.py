#!/usr/bin/env python3
"""How far SD Accel's LOSSY modes move the images of YOUR checkpoint: a report you run yourself.

Loads the checkpoint in process through ComfyUI (its own loader and nodes, as a workflow would), renders the
fixed prompt set (bench/quality_prompts.txt; prompt i with seed --seed + i) with the Accelerated KSampler's
lossless defaults (the reference) and with each mode given, and writes a markdown report (and the same numbers
as JSON beside it): PSNR of each image against the reference, per image and the mean; LPIPS and CLIP score
where the `lpips` and `open_clip` (or `transformers`) packages and their weights are available, else one line
that says why not. No number in it says anything of another checkpoint.

A mode is the Accelerated KSampler inputs it sets, e.g. "step_cache=interval 3" or
"step_cache=non-uniform 5,step_cache_branch=1"; "fp16" is the reference itself (a check: identical images,
PSNR inf). LOSSY_INPUTS names the inputs that change the image; a new lossy input (fp8) is added there by name.

  python3 bench/quality.py --ckpt models/checkpoints/my_model.safetensors --comfy-dir ~/ComfyUI \\
      --mode "step_cache=interval 3" --mode "step_cache=non-uniform 3" [--limit 4] [--out report.md]
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402
import quality_metrics as qm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = "fp16"          # a mode string: the reference's own inputs (none), for a check of determinism
REFERENCE_ROW = "reference"
NEGATIVE = "blurry, low quality"
# the Accelerated KSampler inputs that change the image (each says LOSSY in its tooltip)
LOSSY_INPUTS = ("step_cache", "step_cache_branch")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="the checkpoint file (.safetensors / .ckpt) to measure")
    ap.add_argument("--comfy-dir", default=os.path.join(cb.REPO, "vendor", "ComfyUI"), help="a ComfyUI checkout")
    ap.add_argument("--mode", action="append", default=[], help='a lossy mode, e.g. "step_cache=interval 3" '
                    "(repeat for several)")
    ap.add_argument("--prompts", default=os.path.join(HERE, "quality_prompts.txt"))
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
    ap.add_argument("--size", type=int, default=0, help="image side in pixels (0: 1024 for SDXL, else 512)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=7.0)
    ap.add_argument("--sampler", default="euler")
    ap.add_argument("--scheduler", default="normal")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="quality_report.md", help="the markdown report; its numbers go to .json beside")
    ap.add_argument("--metrics", default="psnr,lpips,clip", help="comma list of psnr, lpips, clip")
    ap.add_argument("--clip-model", default="ViT-B-32/openai", help="open_clip ARCH/PRETRAINED for the CLIP score")
    ap.add_argument("--clip-hub-model", default="openai/clip-vit-base-patch32",
                    help="transformers model for the CLIP score when open_clip is not installed")
    ap.add_argument("--cpu", action="store_true", help="run ComfyUI on the CPU (slow; for a check of the script)")
    ap.add_argument("--comfy-args", default="", help="arguments for ComfyUI's own parser")
    return ap.parse_args(argv)


def read_prompts(path, limit):
    with open(path) as f:
        prompts = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return prompts[:limit] if limit else prompts


def parse_mode(text, optional_inputs):
    """{input: value} of a mode string; values typed as the Accelerated KSampler's inputs declare them."""
    if text.strip() == REFERENCE:
        return {}
    inputs = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or name not in optional_inputs:
            raise SystemExit("mode %r: %r is not an Accelerated KSampler input (lossy ones: %s)"
                             % (text, name, ", ".join(LOSSY_INPUTS)))
        kind = optional_inputs[name][0]
        if isinstance(kind, list) and value not in kind:
            raise SystemExit("mode %r: %s must be one of: %s" % (text, name, ", ".join(map(str, kind))))
        inputs[name] = int(value) if kind == "INT" else (value.lower() == "true") if kind == "BOOLEAN" else value
    return inputs


def is_lossy(inputs, optional_inputs):
    return any(k in LOSSY_INPUTS and v != optional_inputs[k][1].get("default") for k, v in inputs.items())


def boot(opt):
    env_opt = argparse.Namespace(smoke=opt.cpu, comfy_args=opt.comfy_args, comfy_dir=opt.comfy_dir,
                                 out=os.path.dirname(os.path.abspath(opt.out)), work=os.path.join(
                                     os.path.dirname(os.path.abspath(opt.out)), ".quality_work"))
    return cb.boot(env_opt, ())


def load_checkpoint(env, path):
    """(model, clip, vae) by ComfyUI's own loader, as CheckpointLoaderSimple loads them."""
    import comfy.sd
    import folder_paths
    with env.torch.inference_mode():
        return comfy.sd.load_checkpoint_guess_config(os.path.abspath(path), output_vae=True, output_clip=True,
                                                     embedding_directory=folder_paths.get_folder_paths(
                                                         "embeddings"))[:3]


def render(env, opt, model, clip, vae, prompt, seed, size, inputs):
    """One image of the Accelerated KSampler with `inputs`: (image, its run report)."""
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    nodes = env.nodes
    with env.torch.inference_mode():
        pos = nodes.CLIPTextEncode().encode(clip, prompt)[0]
        neg = nodes.CLIPTextEncode().encode(clip, NEGATIVE)[0]
        latent = nodes.EmptyLatentImage().generate(size, size, 1)[0]
        res = SDAccelKSampler().sample(model, seed, opt.steps, opt.cfg, opt.sampler, opt.scheduler, pos, neg,
                                       latent, **inputs)
        img = nodes.VAEDecode().decode(vae, res["result"][0])[0]
    return img.float().cpu(), res["ui"]["sdaccel_report"][0] or {}


def _mode_note(report):
    """What the run report said of the lossy options: ran (with LOSSY) or fell back, and why."""
    ran = [r for r in report.get("ran", []) if "LOSSY" in r]
    fell = ["%s: %s" % kv for kv in report.get("fell_back", {}).items() if kv[0].startswith("step_cache")]
    return "; ".join(ran + fell)


def measure(env, opt, model, clip, vae, prompts, modes, scorers):
    """{mode: {"images": [...], "its": [...], "note": str, ...}} with the reference first."""
    size = opt.size or (1024 if "SDXL" in type(model.model.model_config).__name__ else 512)
    out = {}
    for name, inputs in [(REFERENCE_ROW, {})] + modes:
        runs = [render(env, opt, model, clip, vae, p, opt.seed + i, size, inputs) for i, p in enumerate(prompts)]
        out[name] = {"inputs": inputs, "images": [img for img, _ in runs],
                     "its": [r.get("it_s") for _, r in runs], "note": _mode_note(runs[-1][1])}
    ref = out[REFERENCE_ROW]["images"]
    for name, m in out.items():
        m["psnr"] = [qm.psnr(img, r) for img, r in zip(m["images"], ref)]
        if scorers.get("lpips"):
            m["lpips"] = [scorers["lpips"](img, r) for img, r in zip(m["images"], ref)]
        if scorers.get("clip"):
            m["clip"] = [scorers["clip"](img, p) for img, p in zip(m["images"], prompts)]
    return out, size


def _mean_psnr(values):
    finite = [v for v in values if math.isfinite(v)]
    return math.inf if not finite else statistics.mean(finite)


def _db(v):
    return "inf (identical)" if math.isinf(v) else "%.2f" % v


def summarize(results, optional_inputs):
    rows = []
    for name, m in results.items():
        its = [v for v in m["its"] if v]
        row = {"mode": name, "lossy": is_lossy(m["inputs"], optional_inputs), "inputs": m["inputs"],
               "it_s": statistics.median(its) if its else None, "psnr": m["psnr"],
               "psnr_mean": _mean_psnr(m["psnr"]), "identical": sum(math.isinf(v) for v in m["psnr"]),
               "note": m["note"]}
        for k in ("lpips", "clip"):
            if k in m:
                row[k], row[k + "_mean"] = m[k], statistics.mean(m[k])
        rows.append(row)
    ref_clip = rows[0].get("clip_mean")
    for row in rows:
        if ref_clip is not None:
            row["clip_delta"] = row["clip_mean"] - ref_clip
    return rows


def markdown(opt, env_info, size, prompts, rows, skipped):
    lines = ["# SD Accel quality report", "",
             "Checkpoint `%s`, %dx%d, %d steps, %s / %s, CFG %g, seeds %d..%d; %s, torch %s, ComfyUI %s." % (
                 os.path.basename(opt.ckpt), size, size, opt.steps, opt.sampler, opt.scheduler, opt.cfg, opt.seed,
                 opt.seed + len(prompts) - 1, env_info["gpu"], env_info["torch"], env_info["comfyui"]), "",
             "Reference: the Accelerated KSampler's lossless defaults (fp16 on a GPU; mode `%s` renders them "
             "again). Each mode's images are compared with the reference's, same prompt and seed. LOSSY modes "
             "change the image; these numbers hold for this checkpoint and these settings only." % REFERENCE, ""]
    lines += ["| mode | lossy | it/s | mean PSNR dB | LPIPS | CLIP score (Δ vs reference) | run report |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        clip = "%.2f (%+.3f)" % (r["clip_mean"], r["clip_delta"]) if "clip_mean" in r else "-"
        lines.append("| %s | %s | %s | %s | %s | %s | %s |" % (
            r["mode"], "LOSSY" if r["lossy"] else "no", "%.2f" % r["it_s"] if r["it_s"] else "-",
            _db(r["psnr_mean"]) + (" (%d identical)" % r["identical"] if r["identical"] and
                                   math.isfinite(r["psnr_mean"]) else ""),
            "%.4f" % r["lpips_mean"] if "lpips_mean" in r else "-", clip, r["note"] or "-"))
    lines += ["", "PSNR per image (dB, against the reference):", "",
              "| # | prompt | " + " | ".join(r["mode"] for r in rows) + " |", "|---|---|" + "---|" * len(rows)]
    for i, p in enumerate(prompts):
        lines.append("| %d | %s | %s |" % (i, p[:60], " | ".join(_db(r["psnr"][i]) for r in rows)))
    lines += [""] + ["- " + s for s in skipped]
    return "\n".join(lines) + "\n"


def scorers_for(opt):
    wanted = set(filter(None, opt.metrics.split(",")))
    scorers, skipped = {}, []
    if "lpips" in wanted:
        scorers["lpips"], why = qm.lpips_scorer()
        skipped += [why] if why else []
    else:
        skipped.append("LPIPS not computed: not asked for (--metrics)")
    if "clip" in wanted:
        scorers["clip"], why = qm.clip_scorer(opt.clip_model, opt.clip_hub_model)
        skipped += [why] if why else []
    else:
        skipped.append("CLIP score not computed: not asked for (--metrics)")
    return scorers, skipped


def main(argv=None):
    opt = parse_args(argv)
    t0 = time.time()
    prompts = read_prompts(opt.prompts, opt.limit)
    env = boot(opt)
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    optional_inputs = SDAccelKSampler.INPUT_TYPES()["optional"]
    modes = [(m, parse_mode(m, optional_inputs)) for m in opt.mode]
    model, clip, vae = load_checkpoint(env, opt.ckpt)
    scorers, skipped = scorers_for(opt)
    results, size = measure(env, opt, model, clip, vae, prompts, modes, scorers)
    rows = summarize(results, optional_inputs)
    env_info = cb.versions(env, opt.comfy_dir)
    text = markdown(opt, env_info, size, prompts, rows, skipped)
    with open(opt.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(opt.out)[0] + ".json", "w") as f:
        json.dump({"checkpoint": os.path.basename(opt.ckpt), "size": size, "steps": opt.steps,
                   "prompts": prompts, "env": dict(env_info, python=platform.python_version()), "rows": rows,
                   "not_computed": skipped, "seconds": round(time.time() - t0, 1)}, f, indent=1, default=str)
    print(text)


if __name__ == "__main__":
    main()
