#!/usr/bin/env python3
"""Stock after SD Accel: is ComfyUI's own KSampler as fast on a loaded model after the Accelerated KSampler ran on it?

SD Accel captures its graphs over conv weights in channels_last, converted in place on the loaded model, which
is the user's: stock KSampler, another pack's sampler and our own graphs-off path run the same weights. Per
family, one process: stock KSampler and the Accelerated KSampler with graphs off, twice each (ABAB), before any
graph ran; then the Accelerated KSampler with graphs (the conversion and the captures); then the same ABAB
again. Configs `stock_after_sd15_512_b1`, `stock_after_sdxl_1024_b1`: `stock_its` / `ours_eager_its` before,
`stock_after_its` / `eager_after_its` after (each the mean of its two ABAB medians), `ours_its` with graphs,
`psnr_db` stock after against stock before (99 when identical). The VAE the same way: stock VAE Decode's ms
per decode of one latent before and after VAE Decode (SD Accel) decoded it (its graphs are captured over the
VAE's conv weights in channels_last, converted in place): `stock_vae_ms`, `ours_vae_ms`, `stock_vae_after_ms`.

GPU:    python3 bench/bench_stock_after.py --comfy-dir vendor/ComfyUI --out $OUT
Smoke:  python3 bench/bench_stock_after.py --smoke        (CPU plumbing, tiny models)
"""
import argparse
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

FAMILIES = {"sd15": 512, "sdxl": 1024}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cb.add_common_args(ap, deadline=280.0)
    ap.add_argument("--families", default="sd15,sdxl")
    ap.add_argument("--steps", type=int, default=None, help="default 20 (2 with --smoke)")
    opt = ap.parse_args()
    if opt.steps is None:
        opt.steps = 2 if opt.smoke else 20
    return opt


OPT = parse_args()
ENV = cb.boot(OPT)


def its(model, clip, vae, size, sampler, accel=None):
    """Sampler steps per second: a warm-up, then the median of --reps timed runs (seeds 100, 101, ...)."""
    run = lambda seed: cb.run_graph(ENV, model, clip, vae, size, 1, seed, sampler, OPT.steps, accel=accel)  # noqa
    run(1)
    out = [run(100 + i) for i in range(OPT.reps)]
    return OPT.steps / statistics.median(r["sample_s"] for r in out), out[0]["img"]


def abab(model, clip, vae, size):
    stock, eager, img = [], [], None
    for _ in range(2):
        s, img = its(model, clip, vae, size, "stock")
        stock.append(s)
        eager.append(its(model, clip, vae, size, "ours", {"cuda_graph": False})[0])
    return stock, eager, img


def vae_ms(vae, latent, ours):
    """ms per decode of `latent` (stock VAE Decode or VAE Decode (SD Accel)): a warm-up, then the median of --reps."""
    from sd_accel.nodes.vae_nodes import SDAccelVAEDecode

    def decode():
        with ENV.torch.inference_mode():
            if ours:
                SDAccelVAEDecode().decode(latent, vae)
            else:
                ENV.nodes.VAEDecode().decode(vae, latent)
    return cb.median_ms(ENV, decode, OPT.reps)


def main():
    env_info = cb.versions(ENV, OPT.comfy_dir)
    loaded = {}
    for fam in OPT.families.split(","):
        size = 64 if OPT.smoke else FAMILIES[fam]
        model, clip, vae = cb.load_family(ENV, OPT, fam, loaded)
        stock, eager, img_before = abab(model, clip, vae, size)
        ours, _ = its(model, clip, vae, size, "ours")
        stock_after, eager_after, img_after = abab(model, clip, vae, size)
        latent = {"samples": ENV.torch.randn(1, 4, size // 8, size // 8)}
        stock_vae = vae_ms(vae, latent, ours=False)
        ours_vae = vae_ms(vae, latent, ours=True)
        stock_vae_after = vae_ms(vae, latent, ours=False)
        rec = dict(env_info, date=datetime.date.today().isoformat(), config="stock_after_%s_%d_b1" % (fam, size),
                   steps=OPT.steps, sampler="euler", scheduler="normal", cfg=7.0,
                   stock_its=round(statistics.mean(stock), 2), ours_its=round(ours, 2),
                   speedup=round(ours / statistics.mean(stock), 3),
                   ours_eager_its=round(statistics.mean(eager), 2),
                   stock_after_its=round(statistics.mean(stock_after), 2),
                   eager_after_its=round(statistics.mean(eager_after), 2),
                   psnr_db=round(cb.psnr(img_before, img_after), 2),
                   stock_vae_ms=round(stock_vae, 2), ours_vae_ms=round(ours_vae, 2),
                   stock_vae_after_ms=round(stock_vae_after, 2),
                   notes="ABAB medians: stock %s, eager %s before; stock %s, eager %s after one graph run" % (
                       ["%.2f" % v for v in stock], ["%.2f" % v for v in eager],
                       ["%.2f" % v for v in stock_after], ["%.2f" % v for v in eager_after]))
        if OPT.smoke:
            cb.say("RESULT (smoke, not recorded)", rec)
        else:
            cb.append_record(OPT, rec)


if __name__ == "__main__":
    main()
