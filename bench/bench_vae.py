"""VAE decode and encode: ComfyUI's own VAE against its SD Accel copy (hosts/comfyui/vae_accel.py), in one process.

Two comfy.sd.VAE objects of the same random full-size weights (SD1.5's and SDXL's VAEs are one architecture),
one stock and one accelerated, so the accelerated copy's channels_last weights never reach the stock side. Per
config, the same latents (decode) or images (encode) go through `vae.decode` / `vae.encode` (what VAE Decode and
VAE Encode call) for each variant:
  stock        ComfyUI's VAE
  ours         Apply SD Accel (VAE)'s copy, defaults (fused kernels, channels_last, CUDA graphs)
  ours_eager   the copy without CUDA graphs (where graphs are refused, it must still not be slower than stock)
Each variant: warm-up calls (compiling, the graph's probe and capture), then timed calls (CUDA events, median);
the peak allocated memory over its calls after the first (and apart: over the timed calls alone, what each later
decode takes, and per warm-up call, where a graph's probe and capture run); the memory still reserved after its
calls and the driver's graph memory they added (a graph's memory stays: torch's private pool under the native allocator, the
driver's graph pool under ComfyUI's default cudaMallocAsync); the image's PSNR against stock's (decode) or the latent's relative error
(encode). One JSON line per config to <out>/results.jsonl (../shared/BENCH.md), then a table.

    python3 bench/bench_vae.py --comfy-dir vendor/ComfyUI --out $OUT/vae    # GPU, ~3 min on the H200
    python3 bench/bench_vae.py --smoke                                     # CPU plumbing check, a small VAE
"""
import argparse
import contextlib
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

# (config, method, image px, batch, tiled)
CONFIGS = [("vae_decode_sd15_512_b1", "decode", 512, 1, False),
           ("vae_decode_sd15_512_b4", "decode", 512, 4, False),
           ("vae_decode_sdxl_1024_b1", "decode", 1024, 1, False),
           ("vae_decode_tiled_sdxl_1024_b1", "decode", 1024, 1, True),
           ("vae_encode_sd15_512_b1", "encode", 512, 1, False),
           ("vae_encode_sd15_512_b4", "encode", 512, 4, False),
           ("vae_encode_sdxl_1024_b1", "encode", 1024, 1, False)]
SMOKE_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
                  "ch_mult": [1, 2, 4, 4], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}
TILING = {"tile_x": 64, "tile_y": 64, "overlap": 8}   # VAE Decode (Tiled)'s defaults on current ComfyUI (latent px)
SMOKE_TILING = {"tile_x": 8, "tile_y": 8, "overlap": 2}


def _inputs(torch, method, px, batch):
    g = torch.Generator().manual_seed(7)
    if method == "decode":
        return torch.randn(batch, 4, px // 8, px // 8, generator=g)
    return torch.rand(batch, px, px, 3, generator=g)


def _call(env, vae, method, x, tiling):
    if method == "encode":
        env.torch.manual_seed(0)   # ComfyUI 2024 samples the latent from the global generator
        return vae.encode(x)
    if tiling:
        return vae.decode_tiled(x, **tiling)
    return vae.decode(x)


def _measure(env, opt, vae, method, x, tiling, info=None):
    """{"ms", "peak_gib", "reserved_gib", "graph_gib", "out", "accel"} of one variant, which starts with no model
    loaded. The peak is over every call after the first (which loads the weights and compiles the kernels on
    their plain-torch references): the weights, the working memory, a graph's capture."""
    torch = env.torch
    from sd_accel.hosts.comfyui import vae_accel
    env.mm.unload_all_models()
    env.mm.soft_empty_cache()
    graph0 = cb.graph_mem_bytes(env.cuda) or 0
    accel, times, warm_peaks, timed_peaks = {}, [], [], []
    with torch.inference_mode():
        for i in range(opt.warmup):
            # the first call (loading the weights, compiling on the kernels' references) is left out of the peaks
            out = _peak_of(env, lambda: _call(env, vae, method, x, tiling), warm_peaks if i else [])
        with vae_accel.measured(info, accel) if info is not None else contextlib.nullcontext():
            for _ in range(opt.reps):
                times.append(_peak_of(env, lambda: _timed(env, lambda: _call(env, vae, method, x, tiling)),
                                      timed_peaks))
            out = _call(env, vae, method, x, tiling)
    cb.sync(env)
    gib = float(2 ** 30)
    peak = max(warm_peaks + timed_peaks, default=0.0) / gib
    reserved = torch.cuda.memory_reserved() / gib if env.cuda else 0.0
    graph = ((cb.graph_mem_bytes(env.cuda) or 0) - graph0) / gib
    times.sort()
    return {"ms": times[len(times) // 2], "peak_gib": peak, "reserved_gib": reserved, "graph_gib": graph,
            "steady_peak_gib": max(timed_peaks, default=0.0) / gib,
            "warmup_peaks_gib": [round(b / gib, 3) for b in warm_peaks], "out": out.float().cpu(), "accel": accel}


def _peak_of(env, fn, peaks):
    """fn(), with the peak allocated memory during it appended to `peaks` (bytes; nothing on the CPU)."""
    torch = env.torch
    if env.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    out = fn()
    if env.cuda:
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    return out


def _timed(env, fn):
    torch = env.torch
    if not env.cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _record(env_info, tag, method, stock, ours, eager, vae):
    r = dict(env_info, date=datetime.date.today().isoformat(), config=tag,
             stock_ms=round(stock["ms"], 2), ours_ms=round(ours["ms"], 2), ours_eager_ms=round(eager["ms"], 2),
             speedup=round(stock["ms"] / ours["ms"], 3), speedup_eager=round(stock["ms"] / eager["ms"], 3),
             stock_peak_gib=round(stock["peak_gib"], 3), ours_peak_gib=round(ours["peak_gib"], 3),
             ours_eager_peak_gib=round(eager["peak_gib"], 3),
             stock_steady_peak_gib=round(stock["steady_peak_gib"], 3), ours_steady_peak_gib=round(
                 ours["steady_peak_gib"], 3), ours_eager_steady_peak_gib=round(eager["steady_peak_gib"], 3),
             ours_warmup_peaks_gib=ours["warmup_peaks_gib"], ours_eager_warmup_peaks_gib=eager["warmup_peaks_gib"],
             stock_reserved_gib=round(stock["reserved_gib"], 3),
             ours_reserved_gib=round(ours["reserved_gib"], 3), ours_graph_mem_gib=round(ours["graph_gib"], 3),
             graphs="cuda_graph %s" % method in " ".join(ours["accel"].get("ran", [])),
             vae_dtype=str(vae.vae_dtype).replace("torch.", ""),
             notes="ours: %s | eager: %s" % (ours["accel"].get("line"), eager["accel"].get("line")))
    if method == "decode":
        r["psnr_db"] = round(cb.psnr(stock["out"], ours["out"]), 2)
        r["psnr_eager_db"] = round(cb.psnr(stock["out"], eager["out"]), 2)
    else:
        r["latent_rel_err"] = float("%.3g" % _rel(ours["out"], stock["out"]))
        r["latent_rel_err_eager"] = float("%.3g" % _rel(eager["out"], stock["out"]))
    return r


def _table(recs):
    cb.say("%-31s %9s %9s %9s %7s %10s %10s %10s %8s %6s" % ("config", "stock ms", "ours ms", "eager ms", "x",
                                                              "stock GiB", "ours GiB", "steady", "quality", "graphs"))
    for r in recs:
        q = "%.1fdB" % r["psnr_db"] if "psnr_db" in r else "%.1e" % r["latent_rel_err"]
        cb.say("%-31s %9.2f %9.2f %9.2f %7.2f %10.3f %10.3f %10.3f %8s %6s" % (
            r["config"], r["stock_ms"], r["ours_ms"], r["ours_eager_ms"], r["speedup"], r["stock_peak_gib"],
            r["ours_peak_gib"], r["ours_steady_peak_gib"], q, r["graphs"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cb.add_common_args(ap, deadline=200.0)
    ap.add_argument("--warmup", type=int, default=5,
                    help="untimed calls per variant: compiling, a graph's probe and capture, the eager path's choice")
    ap.add_argument("--configs", default="", help="comma-separated config names (default: all)")
    opt = ap.parse_args()
    opt.reps = max(opt.reps, 10)
    if opt.smoke:
        opt.reps, opt.warmup = 1, 1
    env = cb.boot(opt, model_folders=())
    import fixtures
    from sd_accel.hosts.comfyui import vae_accel
    ddconfig = SMOKE_DDCONFIG if opt.smoke else None
    stock_vae = fixtures.random_vae(opt.comfy_dir, seed=21, ddconfig=ddconfig)
    base = fixtures.random_vae(opt.comfy_dir, seed=21, ddconfig=ddconfig)
    ours_vae, ours_info = vae_accel.accelerate_vae(base)
    eager_vae, eager_info = vae_accel.accelerate_vae(base, vae_accel.VAEOptions(cuda_graph=False))
    cb.say("VAE %s on %s; ours: %s" % (stock_vae.vae_dtype, env.dev, ours_info["reasons"] or "accelerated"))
    env_info = cb.versions(env, opt.comfy_dir)
    wanted = set(filter(None, opt.configs.split(",")))
    recs = []
    for tag, method, px, batch, tiled in CONFIGS:
        if wanted and tag not in wanted:
            continue
        if time.time() - cb.T0 > opt.deadline:
            cb.say("SKIP %s: past the %.0f s deadline" % (tag, opt.deadline))
            continue
        if opt.smoke:
            px //= 8
        x = _inputs(env.torch, method, px, batch)
        tiling = (SMOKE_TILING if opt.smoke else TILING) if tiled else None
        stock = _measure(env, opt, stock_vae, method, x, tiling)
        ours = _measure(env, opt, ours_vae, method, x, tiling, ours_info)
        eager = _measure(env, opt, eager_vae, method, x, tiling, eager_info)
        rec = _record(env_info, tag, method, stock, ours, eager, stock_vae)
        cb.append_record(opt, rec)
        recs.append(rec)
    _table(recs)
    if opt.smoke:
        cb.say("smoke: a plumbing check on the CPU, one call per variant of the same stock modules; no timing here "
               "means anything")


if __name__ == "__main__":
    main()
