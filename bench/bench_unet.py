#!/usr/bin/env python3
"""Stock ComfyUI vs SD Accel (vs ComfyUI's TorchCompileModel), side by side in one process, same seeds.

GPU machine only. Runs ComfyUI's own nodes in-process, in main.py's start-up order (so the default
cudaMallocAsync allocator is in force): CheckpointLoaderSimple -> CLIPTextEncode x2 -> EmptyLatentImage
-> KSampler | SDAccelKSampler | TorchCompileModel+KSampler -> VAEDecode, on random full-size SD1.5 and
SDXL checkpoints built here with dev/fixtures.py. Prints a table and appends one JSON line per config
(fields of ../shared/BENCH.md) to $OUT/results.jsonl.

  python3 bench/bench_unet.py --comfy-dir vendor/ComfyUI --out $OUT [--configs sd15_512_b1,...] [--compile sd15_512_b1]
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

ap = argparse.ArgumentParser()
cb.add_common_args(ap)
ap.add_argument("--configs", default="sd15_512_b1,sd15_512_b4,sd15_768_b1,sdxl_1024_b1")
ap.add_argument("--compile", default="sd15_512_b1", help="configs also run through TorchCompileModel (inductor)")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--profile", default="", help="configs to profile (2 steps of ours, kernel table)")
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
torch, nodes, mm, fixtures = ENV.torch, ENV.nodes, ENV.mm, ENV.fixtures
CUDA, DEV = ENV.cuda, ENV.dev
say, psnr = cb.say, cb.psnr
from sd_accel.engine.patches import layout_modules, patching  # noqa: E402

GEOM = {"sd15_512_b1": ("sd15", 512, 1), "sd15_512_b4": ("sd15", 512, 4), "sd15_768_b1": ("sd15", 768, 1),
        "sdxl_1024_b1": ("sdxl", 1024, 1)}
LOADED = {}



def load(kind):
    return cb.load_family(ENV, OPT, kind, LOADED)


def graph(model, clip, vae, size, batch, seed, sampler):
    return cb.run_graph(ENV, model, clip, vae, size, batch, seed, sampler, OPT.steps)


def measure(model, clip, vae, size, batch, sampler):
    from sd_accel.kernels import _launch
    launches0 = dict(_launch.first_launches)
    first = graph(model, clip, vae, size, batch, 1, sampler)
    first["triton_first_launches"] = _launch.first_launches["count"] - launches0["count"]
    first["triton_first_launch_s"] = _launch.first_launches["seconds"] - launches0["seconds"]
    first["triton_ahead"] = _launch.first_launches["ahead"] - launches0["ahead"]
    first["triton_ahead_s"] = _launch.first_launches["ahead_seconds"] - launches0["ahead_seconds"]
    runs = [graph(model, clip, vae, size, batch, 100 + r, sampler) for r in range(OPT.reps)]
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    return {"its": OPT.steps / med("sample_s"), "sample_s": med("sample_s"), "e2e_s": med("e2e_s"),
            "peak_gib": max(r["peak_gib"] for r in runs), "first_s": first["sample_s"], "img": runs[0]["img"],
            "report": runs[-1]["report"], "first_report": first["report"],
            "triton_first_launches": first["triton_first_launches"], "triton_first_launch_s": first["triton_first_launch_s"],
            "triton_ahead": first["triton_ahead"], "triton_ahead_s": first["triton_ahead_s"]}


def unet_rel_err(model, size, batch, profile_tag=None):
    """One UNet forward, stock vs SD Accel's patches (those Accelerated KSampler applies: fused modules,
    ResBlock and SpatialTransformer stand-ins) + channels_last, same input (CFG batch).
    With `profile_tag`: also two tables of where the patched forward's GPU time goes, per aten op and
    input shape, then per op name alone (eager: a replayed graph shows kernels only, without the op that
    launched them)."""
    bm = model.model
    dm = bm.diffusion_model
    dt = bm.get_dtype()
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn((2 * batch, 4, size // 8, size // 8), device=DEV, dtype=dt, generator=g)
    t = torch.full((2 * batch,), 500.0, device=DEV)
    ctx_dim = bm.model_config.unet_config["context_dim"]
    ctx = torch.randn((2 * batch, 77, ctx_dim), device=DEV, dtype=dt, generator=g)
    kw = {}
    adm = bm.model_config.unet_config.get("adm_in_channels")
    if adm:
        kw["y"] = torch.randn((2 * batch, adm), device=DEV, dtype=dt, generator=g)
    with torch.inference_mode():
        mm.load_models_gpu([model])
        ref = dm(x, t, context=ctx, **kw).float()
        # the host's patch set (hosts/comfyui/accelerate.py): the channels_last SpatialTransformer stand-ins first,
        # then the fused modules and ResBlock stand-ins (COMFY_OPS) set through them
        backups = []
        try:
            if CUDA:
                backups.append(patching.apply_patches(dm, layout_modules.plan_layout_patches(dm)))
                x = x.contiguous(memory_format=torch.channels_last)
            backups.append(patching.apply_patches(dm, patching.plan_patches(dm, patching.COMFY_OPS).patches))
            out = dm(x, t, context=ctx, **kw).float()
            if profile_tag and CUDA:
                _profile_ops(lambda: dm(x, t, context=ctx, **kw), profile_tag)
        finally:
            for backup in reversed(backups):
                patching.restore(dm, backup)
    return float((out - ref).norm() / ref.norm())


def _profile_ops(fn, tag):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    avg = prof.key_averages(group_by_input_shape=True)
    key = "device_time_total" if hasattr(next(iter(avg)), "device_time_total") else "cuda_time_total"
    table = avg.table(sort_by=key, row_limit=45, max_name_column_width=40, max_shapes_column_width=70)
    # the same events grouped by op name alone: which aten ops (add_, cat, copy_, ...) launch the
    # generic elementwise kernels, summed over every shape they ran on
    by_op = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
    with open(os.path.join(OPT.out, "profile_ops_%s.txt" % tag), "w") as f:
        f.write("== per op and input shape, top 45 by GPU time ==\n")
        f.write(table)
        f.write("\n\n== per op name (all shapes together), top 40 by GPU time ==\n")
        f.write(by_op)
    say("PROFILE-OPS", tag, "written", "\n" + by_op[:4000])


def profile_ours(model, clip, vae, size, batch, tag):
    from torch.profiler import ProfilerActivity, profile
    graph(model, clip, vae, size, batch, 5, "ours")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph(model, clip, vae, size, batch, 6, "ours")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(os.path.join(OPT.out, "profile_%s.txt" % tag), "w") as f:
        f.write(table)
    say("PROFILE", tag, "\n" + table[:6000])



def main():
    env = cb.versions(ENV, OPT.comfy_dir)
    say("ENV", json.dumps(env), "allocator:", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    rows = []
    compile_set = set(filter(None, OPT.compile.split(",")))
    for tag in OPT.configs.split(","):
        if time.time() - cb.T0 > OPT.deadline:
            say("SKIP", tag, "past the deadline")
            continue
        kind, size, batch = GEOM[tag]
        if OPT.smoke:
            size = 64
        try:
            model, clip, vae = load(kind)
            stock = measure(model, clip, vae, size, batch, "stock")
            ours = measure(model, clip, vae, size, batch, "ours")
            rec = cb.pair_record(env, OPT, tag, stock, ours)
            rec["unet_rel_err"] = unet_rel_err(model, size, batch,
                                               tag if tag in OPT.profile.split(",") else None)
            rep = ours["report"] or {}
            rec["triton_first_launches"] = ours["triton_first_launches"]
            rec["triton_first_launch_s"] = round(ours["triton_first_launch_s"], 2)
            rec["triton_compiled_ahead"] = ours["triton_ahead"]
            rec["triton_compiled_ahead_s"] = round(ours["triton_ahead_s"], 2)
            rec["notes"] = "ran: %s; fell back: %s; graphs: %s; first run graphs: %s" % (
                ", ".join(rep.get("ran", [])), json.dumps(rep.get("fell_back", {})), json.dumps(rep.get("graphs")),
                json.dumps((ours["first_report"] or {}).get("graphs")))
            if tag in compile_set and time.time() - cb.T0 < OPT.deadline - 120:
                try:
                    from comfy_extras.nodes_torch_compile import TorchCompileModel
                    node = TorchCompileModel()
                    fn = getattr(node, "patch", None) or getattr(TorchCompileModel, "execute")
                    res = fn(model, "inductor")
                    cm = (res.result if hasattr(res, "result") else res)[0]
                    comp = measure(cm, clip, vae, size, batch, "stock")
                    rec["compile_its"] = round(comp["its"], 2)
                    rec["speedup_vs_compile"] = round(ours["its"] / comp["its"], 3)
                    rec["compile_first_run_s"] = round(comp["first_s"] - comp["sample_s"], 1)
                except Exception as e:  # noqa: BLE001
                    rec["notes"] += "; TorchCompileModel failed: %s" % str(e).splitlines()[0][:200]
            if tag in OPT.profile.split(","):
                profile_ours(model, clip, vae, size, batch, tag)
            rows.append(rec)
            cb.append_record(OPT, rec)
        except Exception:  # noqa: BLE001 - keep the other configs
            say("ERROR", tag, traceback.format_exc())
    hdr = "%-14s %9s %9s %7s %9s %8s %8s %8s %8s %7s %9s %7s" % (
        "config", "stock it/s", "ours it/s", "x", "compile", "first s", "e2e st", "e2e ours", "peak st",
        "peak us", "unet err", "PSNR")
    print(hdr)
    for r in rows:
        print("%-14s %9.2f %9.2f %7.2f %9s %8.2f %8.3f %8.3f %8.2f %7.2f %9.2e %7.1f" % (
            r["config"], r["stock_its"], r["ours_its"], r["speedup"], r.get("compile_its", "-"), r["first_run_s"],
            r["stock_e2e_s"], r["ours_e2e_s"], r["stock_peak_gib"], r["ours_peak_gib"], r["unet_rel_err"],
            r["psnr_db"]))


if __name__ == "__main__":
    main()
