#!/usr/bin/env python3
"""The headline benchmark (issue #21): a user's image end to end through a real ComfyUI server.

A ComfyUI server on the GPU with this pack in its custom_nodes (dev/comfy_server.py), driven over HTTP and its
websocket as the browser drives it (dev/comfy_ws.py, a client that says it supports preview metadata where the
server has it, as ComfyUI's frontend does). Per config, the stock graph (KSampler, VAE Decode) against the same
graph with SD Accel's nodes (Accelerated KSampler with its defaults, and VAE Decode (SD Accel) unless
`--ours-decoder stock`; Save Image (SD Accel) with `--ours-saver sdaccel`), alternating stock/ours (ABAB) in ONE
server process, after one warm-up prompt of each (same seed and text: the PSNR of ours against stock):
  latency    s/image, one prompt at a time, POST → the prompt's end on the websocket (median of --reps)
  throughput images/s with N prompts queued at once (N = max(2, --queue-images / batch); median of --reps)
Every timed prompt has a new seed and a new positive text, so its text encode runs as well (ComfyUI would serve
an unchanged text from its cache). Where the time goes, per image (bench/server_timing.py says what each phase
measures): sampling, VAE decode/encode, text encode, ControlNet nodes, save, executor, overhead.

Previews are a server launch flag (`--preview-method`): each method of --previews gets a server process of its
own, started after the last one stopped; stock and ours alternate inside it. With `--one-server`, one server
runs every method: a bench-only node (bench/server_nodes) sets the method per prompt, and stock and ours with
each method alternate (ABAB) in that one process, so the previews' cost is measured within one process too. `taesd` runs on random-weight TAESD
decoders built here into vae_approx (the same network and cost as the real ones).

Configs (`server_<family>_<size>_b<batch>[_cn1|_img2img]`, `_preview` with latent2rgb, `_preview_taesd`):
SD1.5 512² b1 and b4, SDXL 1024² b1 and b4, SD1.5 512² b1 with one ControlNet (a ready edge map through
LoadImage and Apply ControlNet), SD1.5 512² b1 img2img (LoadImage → VAE Encode, denoise 0.6; the same input
image each prompt, so ComfyUI caches its encode as it would for a user); named only, `server_sd15_512_b1_hires_freeu`:
a hires fix (1.5×, denoise 0.5) whose first pass runs a FreeU_V2 clone and whose second the plain model. One JSON line per config and preview
method (../shared/BENCH.md's fields) to $OUT/results.jsonl; the tables last.

  python3 bench/bench_server.py --comfy-dir vendor/ComfyUI --out $OUT [--configs ...] [--previews none,latent2rgb]
  python3 bench/bench_server.py --smoke --out /tmp/bench_server     # CPU plumbing check: tiny UNet, 64 px, 2 steps
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import types
import urllib.error

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import comfy_bench as cb  # noqa: E402
sys.path.insert(0, os.path.join(cb.REPO, "dev"))
import comfy_server  # noqa: E402
import server_graphs as sg  # noqa: E402
import server_timing as st  # noqa: E402

say = cb.say
CONFIGS = {   # name: (family, size, batch, kind)
    "server_sd15_512_b1": ("sd15", 512, 1, "txt2img"),
    "server_sd15_512_b4": ("sd15", 512, 4, "txt2img"),
    "server_sd15_512_b1_cn1": ("sd15", 512, 1, "cn"),
    "server_sd15_512_b1_img2img": ("sd15", 512, 1, "img2img"),
    "server_sdxl_1024_b1": ("sdxl", 1024, 1, "txt2img"),
    "server_sdxl_1024_b4": ("sdxl", 1024, 4, "txt2img"),
    # named only: a hires fix whose first pass runs a FreeU_V2 clone, its second the plain model (server_graphs.py)
    "server_sd15_512_b1_hires_freeu": ("sd15", 512, 1, "hires_freeu"),
}
NAMED_ONLY = ("server_sd15_512_b1_hires_freeu",)
SUFFIX = {"none": "", "latent2rgb": "_preview", "taesd": "_preview_taesd"}
VARIANTS = ("stock", "ours")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cb.add_common_args(ap, deadline=420.0)
    ap.set_defaults(work="/tmp/sdaccel_bench_server")
    ap.add_argument("--configs", default="", help="comma-separated; default: every config (SD1.5 first)")
    ap.add_argument("--previews", default="none,latent2rgb", help="preview methods, one server each: "
                    "none, latent2rgb, taesd")
    ap.add_argument("--one-server", action="store_true",
                    help="every --previews method in ONE server, switched per prompt (bench/server_nodes)")
    ap.add_argument("--steps", type=int, default=None, help="default 20 (2 with --smoke)")
    ap.add_argument("--queue-images", type=int, default=4, help="images per throughput run")
    ap.add_argument("--ours-decoder", choices=("sdaccel", "stock"), default="sdaccel",
                    help="VAE Decode (SD Accel) or VAE Decode in the accelerated graph")
    ap.add_argument("--ours-saver", choices=("stock", "sdaccel"), default="stock",
                    help="Save Image or Save Image (SD Accel) (compress level 1, a batch in parallel) in the "
                         "accelerated graph; sdaccel adds _fastsave to the config names")
    ap.add_argument("--ours-clip", choices=("sdaccel", "stock"), default="sdaccel",
                    help="the checkpoint's CLIP through Apply SD Accel (CLIP) before the text encoders in the "
                         "accelerated graph, or straight from the loader")
    ap.add_argument("--ours-precision", choices=("fp16", "fp8"), default="fp16",
                    help="the Accelerated KSampler's precision; fp8 (LOSSY) adds _fp8 to the config names")
    ap.add_argument("--ours-step-cache", default="off",
                    help="the Accelerated KSampler's step_cache (LOSSY unless off); adds _stepcache_<mode>")
    opt = ap.parse_args()
    if opt.steps is None:
        opt.steps = 2 if opt.smoke else 20
    if opt.smoke:
        opt.reps = min(opt.reps, 2)
    return opt


def build_models(opt, configs, previews):
    """The random checkpoints the configs need (built once into --work/models), named after their preset."""
    preset = "tiny" if opt.smoke else "sd15"
    models = os.path.join(opt.work, "models")
    names = {"sd15": ("checkpoints", "server_sd15_%s.safetensors" % preset, ["--kind", "sd15", "--preset", preset]),
             "sdxl": ("checkpoints", "server_sdxl.safetensors", ["--kind", "sdxl"]),
             "cn": ("controlnet", "server_cn15_%s.safetensors" % preset, ["--kind", "cn15", "--preset", preset])}
    if "taesd" in previews:
        names["taesd"] = ("vae_approx", "taesd_decoder.safetensors", ["--kind", "taesd"])
        names["taesdxl"] = ("vae_approx", "taesdxl_decoder.safetensors", ["--kind", "taesd"])
    wanted = {CONFIGS[c][0] for c in configs} | {"cn" for c in configs if CONFIGS[c][3] == "cn"}
    wanted |= {k for k in ("taesd", "taesdxl") if k in names}
    out = {}
    for key in sorted(wanted):
        folder, name, args = names[key]
        path = os.path.join(models, folder, name)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            say("building", path)
            subprocess.run([sys.executable, os.path.join(cb.REPO, "dev", "fixtures.py"), "--comfy-dir", opt.comfy_dir,
                            "--out", path, "--seed", "1234"] + args, check=True, stdout=subprocess.DEVNULL)
        out[key] = name
    return models, out


def versions(opt):
    """BENCH.md's version fields: torch, Triton and the GPU from this process (the server's Python), ComfyUI's
    from its folder."""
    import torch
    if os.path.abspath(opt.comfy_dir) not in sys.path:
        sys.path.append(os.path.abspath(opt.comfy_dir))   # its comfyui_version module (current ComfyUI)
    env = types.SimpleNamespace(torch=torch, cuda=torch.cuda.is_available() and not opt.smoke)
    return cb.versions(env, opt.comfy_dir)


def start_server(opt, models, method, index, total, extra_nodes=()):
    work = os.path.join(opt.work, "server_%s" % method)
    shutil.rmtree(work, ignore_errors=True)
    args = ["--preview-method", method] + opt.comfy_args.split()
    if os.path.isdir(os.path.join(opt.comfy_dir, "comfy_api")):   # current ComfyUI: no frontend package needed
        args += comfy_server.empty_frontend(work)
    env = {"TRITON_INTERPRET": "0"} if opt.smoke else {}   # interpreted kernels take minutes a prompt on a CPU
    srv = comfy_server.ComfyServer(opt.comfy_dir, sys.executable, work, models, extra_args=args, env=env,
                                   cpu=opt.smoke, extra_nodes=extra_nodes)
    t0 = time.time()
    srv.start(timeout=300)
    say("server %d/%d up in %.1fs: --preview-method %s, log %s" % (index, total, time.time() - t0, method, srv.log_path))
    try:
        flags = srv.get("/features", timeout=10)
    except urllib.error.HTTPError:   # ComfyUI 2024: no feature flags, previews without metadata
        flags = None
    ev = srv.events(feature_flags={"supports_preview_metadata": True} if flags else None)
    return srv, ev, flags is not None


def measure(srv, ev, opt, cfg, names, counter, methods=(None,)):
    """Warm-up of each variant (same seed and text), then ABAB: --reps latency prompts, --reps queues. `methods`:
    preview methods switched per prompt (--one-server), each with both variants; None: the server's own. Returns
    one (warm, lat, thr, n) per method, each keyed by variant."""
    family, size, batch, kind = cfg
    variants = [(v, m) for m in methods for v in VARIANTS]

    def make(vm, seed, text, prefix):
        wf = sg.graph(opt, cfg, names, vm[0], seed, text, prefix)
        return wf if vm[1] is None else sg.switch_previews(wf, vm[1])
    warm = {vm: st.run_prompt(srv, ev, make(vm, 1, cb.POS, "warm_" + vm[0])) for vm in variants}
    lat = {vm: [] for vm in variants}
    for _ in range(opt.reps):
        for vm in variants:
            k = next(counter)
            lat[vm].append(st.run_prompt(srv, ev, make(vm, 1000 + k, sg.text(k), "lat_" + vm[0])))
    n = max(2, opt.queue_images // batch)
    thr = {vm: [] for vm in variants}
    for _ in range(opt.reps):
        for vm in variants:
            wfs = []
            for _ in range(n):
                k = next(counter)
                wfs.append(make(vm, 1000 + k, sg.text(k), "thr_" + vm[0]))
            thr[vm].append(n * batch / st.run_queue(srv, ev, wfs))
    return {m: tuple({v: d[(v, m)] for v in VARIANTS} for d in (warm, lat, thr)) + (n,) for m in methods}


def saved_images(srv, run):
    return srv.output_images(srv.get("/history/%s" % run["pid"])[run["pid"]])


def record(srv, opt, vers, name, cfg, method, metadata, index, total, res):
    warm, lat, thr, n = res
    family, size, batch, kind = cfg
    per = {v: statistics.median(r["latency"] for r in lat[v]) / batch for v in VARIANTS}
    img_s = {v: statistics.median(thr[v]) for v in VARIANTS}
    reports = [r["outputs"].get(sg.SAMPLER, {}) or {} for r in lat["ours"]]
    reports = [(o.get("sdaccel_report") or [{}])[0] for o in reports]
    replays = [(r.get("graphs") or {}).get("replays", 0) for r in reports]
    previews = {v: [r["previews"] for r in lat[v]] for v in VARIANTS}
    last = reports[-1] if reports else {}
    config = name + SUFFIX[method] + ("_fastsave" if opt.ours_saver == "sdaccel" else "") + sg.lossy_suffix(opt)
    rec = dict(vers, date=datetime.date.today().isoformat(), config=config, steps=opt.steps,
               sampler="euler", scheduler="normal", cfg=7.0, batch=batch, preview=method,
               precision=opt.ours_precision, step_cache=opt.ours_step_cache,
               stock_s_per_image=round(per["stock"], 4), ours_s_per_image=round(per["ours"], 4),
               latency_speedup=round(per["stock"] / per["ours"], 3),
               stock_img_s=round(img_s["stock"], 3), ours_img_s=round(img_s["ours"], 3),
               throughput_speedup=round(img_s["ours"] / img_s["stock"], 3), queue_n=n,
               stock_e2e_s=round(statistics.median(r["phases"]["executor"] for r in lat["stock"]), 4),
               ours_e2e_s=round(statistics.median(r["phases"]["executor"] for r in lat["ours"]), 4),
               first_run_s=round(warm["ours"]["latency"] - per["ours"] * batch, 3),
               psnr_db=sg.psnr_of(saved_images(srv, warm["stock"]), saved_images(srv, warm["ours"])), graphs=bool(replays) and min(replays) > 0,
               stock_breakdown_s=st.median_phases(lat["stock"], batch),
               ours_breakdown_s=st.median_phases(lat["ours"], batch), previews_per_prompt=previews,
               deferred_previews=os.environ.get("SDACCEL_DEFERRED_PREVIEWS", "1") != "0")
    where = ("one server for every method (--one-server: %s set per prompt, stock and ours with each method "
             "alternating)" % method) if opt.one_server else \
        "server process %d of %d, launched with --preview-method %s (previews are a launch flag)" % (index, total, method)
    rec["notes"] = ("%s; "
                    "websocket client %s; reps %d, ABAB; a new seed and positive text per timed prompt; ours: "
                    "%sSDAccelKSampler (%s) + %s + %s; graphs replays per timed prompt %s; ran: %s; fell back: %s%s" % (
                        where, "with supports_preview_metadata" if metadata else "without feature flags",
                        opt.reps, "SDAccelApplyCLIP + " if opt.ours_clip == "sdaccel" else "", sg.sampler_options(opt),
                        "SDAccelVAEDecode" if opt.ours_decoder == "sdaccel" else "VAEDecode",
                        "SDAccelSaveImage (compress level 1)" if opt.ours_saver == "sdaccel" else "SaveImage", replays,
                        ", ".join(last.get("ran", []) + [n for n in last.get("notes", []) if n.startswith("live previews")]),
                        json.dumps(last.get("fell_back", {})),
                        "; smoke (CPU, tiny UNet)" if opt.smoke else ""))
    if kind == "img2img":
        rec["notes"] += "; img2img denoise %.1f, its LoadImage and VAE Encode cached after the first prompt" % sg.DENOISE
    if kind == "hires_freeu":
        captures = {node: [((r["outputs"].get(node, {}).get("sdaccel_report") or [{}])[0].get("graphs") or {})
                           .get("captures", 0) for r in lat["ours"]] for node in (sg.SAMPLER, sg.HIRES_SAMPLER)}
        rec["notes"] += ("; hires fix %.1fx, denoise %.1f: first pass on a FreeU_V2 clone, second on the plain model; "
                         "captures per timed prompt: first pass %s, second %s" % (
                             sg.HIRES_SCALE, sg.HIRES_DENOISE, captures[sg.SAMPLER], captures[sg.HIRES_SAMPLER]))
    if method == "taesd" and "TAESD previews enabled, but could not find" in srv.log_text():
        rec["notes"] += "; the server found no TAESD decoder: its previews were latent2rgb"
    want = (2 if kind == "hires_freeu" else 1) * opt.steps if method != "none" else 0
    if previews["stock"] != previews["ours"] or set(previews["ours"]) != {want}:
        rec["notes"] += "; PREVIEW COUNTS: stock %s, ours %s, expected %d a prompt" % (
            previews["stock"], previews["ours"], want)
    return rec


def run_method(opt, vers, configs, models, names, method, index, total, counter, rows, switched=None):
    """One server launched with --preview-method `method`; `switched`: the methods its prompts switch to instead
    (--one-server)."""
    extra = [sg.PREVIEW_SWITCH_NODES] if switched else ()
    srv, ev, metadata = start_server(opt, models, method, index, total, extra_nodes=extra)
    try:
        sg.write_inputs(srv.input_dir, configs, CONFIGS, opt)
        for name in configs:
            if time.time() - cb.T0 > opt.deadline:
                say("SKIP", name, "past the deadline")
                continue
            try:
                cfg = sg.sized(opt, CONFIGS[name])
                for m, res in measure(srv, ev, opt, cfg, names, counter, switched or (None,)).items():
                    rec = record(srv, opt, vers, name, cfg, m or method, metadata, index, total, res)
                    cb.append_record(opt, rec)
                    rows.append(rec)
            except Exception:  # noqa: BLE001 - keep the other configs
                say("ERROR", name, traceback.format_exc(), srv.log_tail(30))
    finally:
        ev.close()
        srv.stop()


def print_tables(rows):
    """Where the time goes, then the headline table and the previews' cost last (what a log's tail shows)."""
    print("where the time goes, seconds per image (median of the latency prompts; bench/server_timing.py):")
    print("%-46s" % "config / variant" + "".join("%12s" % c for c in st.COLUMNS))
    for r in rows:
        for v in VARIANTS:
            b = r["%s_breakdown_s" % v]
            print("%-46s" % ("%s %s" % (r["config"], v)) + "".join("%12.4f" % b[c] for c in st.COLUMNS))
    print("\n%-40s %10s %10s %6s %10s %10s %6s %9s %7s" % ("config", "stock s/im", "ours s/im", "x", "stock im/s",
                                                         "ours im/s", "x", "previews", "PSNR"))
    for r in rows:
        pv = "%s/%s" % (r["previews_per_prompt"]["stock"][-1], r["previews_per_prompt"]["ours"][-1])
        print("%-40s %10.3f %10.3f %6.2f %10.3f %10.3f %6.2f %9s %7s" % (
            r["config"], r["stock_s_per_image"], r["ours_s_per_image"], r["latency_speedup"], r["stock_img_s"],
            r["ours_img_s"], r["throughput_speedup"], pv, r["psnr_db"]))
    print_preview_cost(rows)


def print_preview_cost(rows):
    """s/image with previews over s/image without, per config and variant (issue #21's target: ours <= 1.10)."""
    plain = {r["config"]: r for r in rows if r["preview"] == "none"}
    lines = []
    for r in rows:
        base = plain.get(r["config"][:len(r["config"]) - len(SUFFIX[r["preview"]])]) if r["preview"] != "none" else None
        if base is not None:
            lines.append("%-40s stock %.2fx  ours %.2fx" % (r["config"], r["stock_s_per_image"] / base["stock_s_per_image"],
                                                          r["ours_s_per_image"] / base["ours_s_per_image"]))
    if lines:
        print("previews' cost, s/image with them over s/image without (%s):" % (
            "one server, alternating" if any("--one-server" in r["notes"] for r in rows) else
            "servers of their own, same run"))
        print("\n".join(lines))


def main():
    opt = parse_args()
    # gpu_battery.sh's timeout sends SIGTERM: unwind, so each server (its own session) is stopped, not orphaned
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.makedirs(opt.out, exist_ok=True)
    wanted = [c for c in opt.configs.split(",") if c] or [c for c in CONFIGS if c not in NAMED_ONLY]
    unknown = [c for c in wanted if c not in CONFIGS]
    methods = [m for m in opt.previews.split(",") if m]
    if unknown or set(methods) - set(SUFFIX):
        sys.exit("unknown configs %s or previews %s; configs: %s; previews: %s"
                 % (unknown, set(methods) - set(SUFFIX), ", ".join(CONFIGS), ", ".join(SUFFIX)))
    configs = [c for c in CONFIGS if c in wanted]
    if opt.smoke:
        for c in [c for c in configs if CONFIGS[c][0] == "sdxl"]:
            say("SKIP", c, "--smoke: no small SDXL fixture")
        configs = [c for c in configs if CONFIGS[c][0] != "sdxl"]
    vers = versions(opt)
    if not opt.smoke and vers["gpu"] == "cpu":
        sys.exit("no CUDA device: this bench measures a GPU server; --smoke is the CPU plumbing check")
    say("ENV", json.dumps(vers))
    models, names = build_models(opt, configs, methods)
    rows, counter = [], iter(range(10 ** 9))
    if opt.one_server:
        run_method(opt, vers, configs, models, names, "none", 1, 1, counter, rows, switched=methods)
        methods = []
    for i, method in enumerate(methods):
        if time.time() - cb.T0 > opt.deadline:
            say("SKIP", "--preview-method", method, "past the deadline")
            continue
        run_method(opt, vers, configs, models, names, method, i + 1, len(methods), counter, rows)
    print_tables(rows)


if __name__ == "__main__":
    main()
