#!/usr/bin/env python3
"""Stock ComfyUI vs SD Accel with one or two ControlNets, side by side in one process, same seeds.

GPU machine. Runs ComfyUI's own nodes in-process, in main.py's start-up order (so the default
cudaMallocAsync allocator is in force): CheckpointLoaderSimple, ControlNetLoader (x1 or x2: the same
random file loaded twice gives two separate models, as two different ControlNets would), CLIPTextEncode
x2, ControlNetApplyAdvanced chained (strength 1, 0-1), EmptyLatentImage -> KSampler | SDAccelKSampler ->
VAEDecode. Checkpoints and full-size ControlNets are random weights built here with dev/fixtures.py
(`build_checkpoint`, `build_controlnet(kind="sd15"/"sdxl")`). The hint is a random [1, H, W, 3] image at
the output size, like a LoadImage output. Stock and ours alternate run by run (host variance, see
shared/research/gpu_baseline_controlnet.md). Prints a table and appends one JSON line per config
(fields of ../shared/BENCH.md, plus `cn_rel_err`: relative L2 error of one ControlNet step's residuals,
patched vs stock, same input) to $OUT/results.jsonl.

  python3 bench/bench_controlnet.py --comfy-dir vendor/ComfyUI --out $OUT [--configs sd15_512_b1_cn1,...]
  python3 bench/bench_controlnet.py --smoke          # CPU plumbing check: tiny SD1.5 UNet and ControlNet, 64 px

`sd15_512_b1_cn1_condonly` is sd15_512_b1_cn1 with the lossy `controlnet_cond_only` input on (the
ControlNet skips the uncond rows): its psnr_db vs stock is the point, and its cn_rel_err compares the cond
rows only (the notes say whether the uncond rows got zero residuals). `sd15_512_b1_cn1_half` applies the
ControlNet to the first half of the steps only (end percent 0.5): the other steps use the UNet's graph
without it, and ComfyUI's range test reads the timestep every step. Neither is in the default --configs.
"""
import argparse
import contextlib
import inspect
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

GEOM = {  # config -> (model kind, image size, batch, ControlNets)
    "sd15_512_b1_cn0": ("sd15", 512, 1, 0),
    "sd15_512_b1_cn1": ("sd15", 512, 1, 1),
    "sd15_512_b1_cn2": ("sd15", 512, 1, 2),
    "sdxl_1024_b1_cn1": ("sdxl", 1024, 1, 1),
    "sd15_512_b1_cn1_condonly": ("sd15", 512, 1, 1),
    "sd15_512_b1_cn1_half": ("sd15", 512, 1, 1),
}
RANGE = {  # config -> (start, end) percent of ControlNetApplyAdvanced (default 0, 1)
    "sd15_512_b1_cn1_half": (0.0, 0.5),
}
SAMPLER_INPUTS = {  # config -> extra Accelerated KSampler inputs
    "sd15_512_b1_cn1_condonly": {"controlnet_cond_only": True},
}
ap = argparse.ArgumentParser()
cb.add_common_args(ap)
ap.add_argument("--configs", default=None, help="comma list of %s (default: the cn1/cn2 ones; --smoke: SD1.5 "
                                                  "only)" % ", ".join(GEOM))
ap.add_argument("--steps", type=int, default=None, help="default 20 (--smoke: 4)")
OPT = ap.parse_args()
if OPT.steps is None:
    OPT.steps = 4 if OPT.smoke else 20
if OPT.configs is None:
    OPT.configs = "sd15_512_b1_cn1,sd15_512_b1_cn2" + ("" if OPT.smoke else ",sdxl_1024_b1_cn1")
ENV = cb.boot(OPT, ("checkpoints", "controlnet"))
torch, nodes, mm, fixtures = ENV.torch, ENV.nodes, ENV.mm, ENV.fixtures
say, psnr = cb.say, cb.psnr
from sd_accel.hosts.comfyui import controlnet as host_cn  # noqa: E402

PRESET = "tiny" if OPT.smoke else "sd15"
LOADED = {}
CUDA, DEV = ENV.cuda, ENV.dev



def load(kind, n_cn):
    """(model, clip, vae, [ControlNet] * n_cn) of one family, the only family resident."""
    if LOADED.get("kind") != kind:
        LOADED.clear()
        mm.unload_all_models()
        mm.soft_empty_cache()
        name = "random_%s_%s_fp16.safetensors" % (kind, PRESET)
        path = os.path.join(OPT.work, "checkpoints", name)
        fixtures.ensure(path, fixtures.build_checkpoint, OPT.comfy_dir, kind, PRESET, path, 1234)
        with torch.inference_mode():
            LOADED.update(kind=kind, ckpt=nodes.CheckpointLoaderSimple().load_checkpoint(name)[:3], cns=[])
    cns = LOADED["cns"]
    while len(cns) < n_cn:
        cns.append(cb.random_controlnet(ENV, OPT, kind, PRESET))
    return LOADED["ckpt"] + (cns[:n_cn],)


@contextlib.contextmanager
def sampler_inputs(inputs):
    """Runs inside use an Accelerated KSampler with these extra inputs (comfy_bench.run_graph passes none)."""
    import sd_accel.nodes.sampler_nodes as sn
    base = sn.SDAccelKSampler

    class WithInputs(base):
        def sample(self, *args, **kwargs):
            return base.sample(self, *args, **dict(kwargs, **inputs))
    sn.SDAccelKSampler = WithInputs if inputs else base
    try:
        yield
    finally:
        sn.SDAccelKSampler = base


def hint_image(size):
    return torch.rand((1, size, size, 3), generator=torch.Generator().manual_seed(3))


def graph(model, clip, vae, cns, size, batch, seed, sampler, rng=(0.0, 1.0)):
    hint = hint_image(size)

    def add_controlnets(pos, neg):
        for cn in cns:
            pos, neg = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, cn, hint, 1.0, *rng)[:2]
        return pos, neg
    return cb.run_graph(ENV, model, clip, vae, size, batch, seed, sampler, OPT.steps, add_controlnets)


def measure_pair(model, clip, vae, cns, size, batch, rng=(0.0, 1.0)):
    """Warm-up of each, then stock and ours alternating, OPT.reps timed runs each (seeds 100, 101, ...)."""
    first = {s: graph(model, clip, vae, cns, size, batch, 1, s, rng) for s in ("stock", "ours")}
    runs = {"stock": [], "ours": []}
    for r in range(OPT.reps):
        for s in ("stock", "ours"):
            runs[s].append(graph(model, clip, vae, cns, size, batch, 100 + r, s, rng))
    out = {}
    for s, rs in runs.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        out[s] = {"its": OPT.steps / med("sample_s"), "sample_s": med("sample_s"), "e2e_s": med("e2e_s"),
                  "peak_gib": max(r["peak_gib"] for r in rs), "first_s": first[s]["sample_s"], "img": rs[0]["img"],
                  "report": rs[-1]["report"], "line": rs[-1]["line"], "first_report": first[s]["report"]}
    return out["stock"], out["ours"]


def cn_rel_err(model, cns, size, batch, cond_only=False):
    """One step's ControlNet residuals (the whole chain), stock vs patched, same input, CFG batch (cond rows
    first). cond_only: (error on the cond rows, whether the uncond rows got zeros)."""
    bm = model.model
    dt = bm.get_dtype()
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn((2 * batch, 4, size // 8, size // 8), device=DEV, dtype=dt, generator=g)
    sigma = torch.full((2 * batch,), float(bm.model_sampling.sigma(torch.tensor(500.0))), device=DEV)
    cond = {"c_crossattn": torch.randn((2 * batch, 77, bm.model_config.unet_config["context_dim"]), device=DEV,
                                       dtype=dt, generator=g)}
    adm = bm.model_config.unet_config.get("adm_in_channels")
    if adm:
        cond["y"] = torch.randn((2 * batch, adm), device=DEV, dtype=dt, generator=g)
    hint = hint_image(size).movedim(-1, 1)
    stock = None
    for cn in cns:
        stock = cn.copy().set_cond_hint(hint, 1.0).set_previous_controlnet(stock)
    fast, info = host_cn.accelerate_controlnet(stock, host_cn.ControlNetOptions(cond_only=cond_only))
    takes_to = "transformer_options" in inspect.signature(type(stock).get_control).parameters

    def run(c):
        mm.load_models_gpu([model] + c.get_models())
        c.pre_run(bm, lambda p: bm.model_sampling.percent_to_sigma(p))
        to = {"cond_or_uncond": [0, 1]}
        kw = {"transformer_options": to} if takes_to else {}
        try:
            out = c.get_control(x, sigma, dict(cond, transformer_options=to), 2, **kw)
        finally:
            c.cleanup()
        return [v.float() for k in ("input", "middle", "output") for v in out[k] if v is not None]

    with torch.inference_mode():
        ref = run(stock)
        out = run(fast)
        run(stock)   # takes the patches off again
    host_cn.release(info)
    if cond_only:
        err = max(float((a[:batch] - b[:batch]).norm() / b[:batch].norm().clamp_min(1e-12)) for a, b in zip(out, ref))
        return err, all(not a[batch:].any() for a in out)
    return max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(out, ref))



def main():
    env = cb.versions(ENV, OPT.comfy_dir)
    say("ENV", json.dumps(env), "allocator:", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    rows = []
    for tag in OPT.configs.split(","):
        if time.time() - cb.T0 > OPT.deadline:
            say("SKIP", tag, "past the deadline")
            continue
        kind, size, batch, n_cn = GEOM[tag]
        if OPT.smoke:
            if kind != "sd15":
                say("SKIP", tag, "--smoke builds only the tiny SD1.5 preset (a full SDXL ControlNet is 1.25 G "
                                 "parameters)")
                continue
            size = 64
        try:
            model, clip, vae, cns = load(kind, n_cn)
            extra = SAMPLER_INPUTS.get(tag, {})
            with sampler_inputs(extra):
                stock, ours = measure_pair(model, clip, vae, cns, size, batch, RANGE.get(tag, (0.0, 1.0)))
            rec = cb.pair_record(env, OPT, tag, stock, ours)
            cond_only = bool(extra.get("controlnet_cond_only"))
            rec["cn_rel_err"] = cn_rel_err(model, cns, size, batch, cond_only) if cns else None
            what = "smoke (CPU, tiny preset)" if OPT.smoke else "random full-size weights"
            if cond_only and cns:
                rec["cn_rel_err"], zeros = rec["cn_rel_err"]
                what += ("; LOSSY controlnet_cond_only: cn_rel_err on the cond rows, uncond rows %s"
                         % ("zero" if zeros else "NOT zero (ran the full batch)"))
            rep = ours["report"] or {}
            rec["notes"] = "%s; ran: %s; fell back: %s; graphs: %s; first run graphs: %s; report: %s" % (
                what,
                ", ".join(rep.get("ran", [])), json.dumps(rep.get("fell_back", {})), json.dumps(rep.get("graphs")),
                json.dumps((ours["first_report"] or {}).get("graphs")), "; ".join(rep.get("notes", [])))
            rows.append(rec)
            cb.append_record(OPT, rec)
        except Exception:  # noqa: BLE001 - keep the other configs
            say("ERROR", tag, traceback.format_exc())
    print("%-24s %10s %9s %7s %8s %8s %8s %8s %7s %9s %7s" % (
        "config", "stock it/s", "ours it/s", "x", "first s", "e2e st", "e2e ours", "peak st", "peak us",
        "cn err", "PSNR"))
    for r in rows:
        err = "%9.2e" % r["cn_rel_err"] if r["cn_rel_err"] is not None else "%9s" % "-"
        print("%-24s %10.2f %9.2f %7.2f %8.2f %8.3f %8.3f %8.2f %7.2f %s %7.1f" % (
            r["config"], r["stock_its"], r["ours_its"], r["speedup"], r["first_run_s"], r["stock_e2e_s"],
            r["ours_e2e_s"], r["stock_peak_gib"], r["ours_peak_gib"], err, r["psnr_db"]))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
