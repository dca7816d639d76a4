#!/usr/bin/env python3
"""Where the host time of the eager step's stock path goes: a diagnosis, not a benchmark (nothing for
results.jsonl).

Held to the stock modules, SD Accel's SDXL step without graphs took the host 10-12 ms more than stock's in a run
where EasyCache made each step wait for the GPU (bench/RESULTS.md, session 28), and cProfile found no Python of
ours that costs as much. Here the UNet alone is called (ComfyUI's diffusion_model forward, one CFG batch of 2,
the family's full size), on one loaded model, each variant in turn, `--reps` rounds of `--calls` calls:
  stock       the model as ComfyUI loads it, without SD Accel
  stand_ins   SD Accel's clone loaded (its stand-ins in the tree), inside stock_path.stock_modules()
  originals   the same clone as the product's stock path runs it (hosts/comfyui/stock_blocks.py): each folded
              top-level block whose copy computes nothing else swapped back, for the call, to the original it was
              copied from (what stock runs), inside stock_path.stock_modules()
  fused       the clone's stand-ins on their own path
  stock_cl    stock, with the conv weights in channels_last (as a run whose capture was refused has them after
              its first step put them there for the graphs), back in stock's layout after the variant
Per variant, medians over the calls: the host's time to enqueue a call (the call returns before the GPU is done;
the main thread's CPU time over it too) and the call's time to the GPU's end (synchronised after each call, as a
step that reads a GPU value waits). stand_ins against originals prices the stand-ins; originals against stock,
whatever else of ours is in the tree (the folded copies' own attributes, layouts).

  python3 bench/diagnose_stock_path.py --comfy-dir vendor/ComfyUI --out $OUT [--family sd15]
  python3 bench/diagnose_stock_path.py --smoke --reps 2 --calls 2 --out /tmp/diagnose_stock_path   (CPU check)
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap)
ap.add_argument("--family", choices=("sd15", "sdxl"), default="sdxl")
ap.add_argument("--calls", type=int, default=10, help="timed calls per variant and round")
OPT = ap.parse_args()
ENV = cb.boot(OPT)
torch = ENV.torch
LATENT = 8 if OPT.smoke else {"sd15": 64, "sdxl": 128}[OPT.family]
VARIANTS = ("stock", "stand_ins", "originals", "fused", "stock_cl")


_BLOCKS = {}


def originals(unet):
    """The product's own swap (hosts/comfyui/stock_blocks.py): each folded top-level block its plan finds
    swappable replaced by its original, until the scope ends; planned once, as for one sampling run."""
    from sd_accel.hosts.comfyui import stock_blocks
    if "run" not in _BLOCKS:
        _BLOCKS["run"] = stock_blocks.StockBlocks()
        _BLOCKS["run"].enter_run(object())
    return _BLOCKS["run"].originals(unet)


def scope(variant, unet):
    from sd_accel.engine.patches import stock_path
    if variant in ("stand_ins", "originals"):
        stack = contextlib.ExitStack()
        stack.enter_context(stock_path.stock_modules())
        if variant == "originals":
            stack.enter_context(originals(unet))
        return stack
    return contextlib.nullcontext()


def inputs(model):
    g = torch.Generator().manual_seed(0)
    dtype, dev = model.model.get_dtype(), ENV.dev
    cfg = model.model.model_config.unet_config
    x = torch.randn(2, 4, LATENT, LATENT, generator=g).to(dev, dtype)
    t = torch.full((2,), 500.0, device=dev)
    kw = {"context": torch.randn(2, 77, cfg["context_dim"], generator=g).to(dev, dtype), "transformer_options": {}}
    if cfg.get("adm_in_channels"):
        kw["y"] = torch.randn(2, cfg["adm_in_channels"], generator=g).to(dev, dtype)
    return x, t, kw


def timed(unet, variant, x, t, kw):
    """[(enqueue ms, main thread CPU ms, to the GPU's end ms)] of OPT.calls calls."""
    rows = []
    for _ in range(OPT.calls):
        cb.sync(ENV)
        t0, c0 = time.perf_counter(), time.thread_time()
        with scope(variant, unet):
            unet(x, t, **kw)
        t1, c1 = time.perf_counter(), time.thread_time()
        cb.sync(ENV)
        rows.append((1000 * (t1 - t0), 1000 * (c1 - c0), 1000 * (time.perf_counter() - t0)))
    return rows


def main():
    from sd_accel.engine.patches import patching
    from sd_accel.hosts.comfyui import accelerate as host
    model, _, _ = cb.load_family(ENV, OPT, OPT.family, {})
    acc, info = host.accelerate(model, host.AccelOptions(cuda_graph=False))
    x, t, kw = inputs(model)
    unet = model.model.diffusion_model
    rows = {v: [] for v in VARIANTS}
    with torch.inference_mode():
        for _ in range(OPT.reps + 1):   # the first round warms up (kernels compiled, cuDNN plans chosen)
            for v in VARIANTS:
                ENV.mm.load_models_gpu([model if v.startswith("stock") else acc])
                if v == "stock_cl":
                    patching.convert_conv_weights(unet, torch.channels_last)
                rows[v].append(timed(unet, v, x, t, kw))
                if v == "stock_cl":
                    patching.convert_conv_weights(unet, torch.contiguous_format)
    from sd_accel.hosts.comfyui import object_patches
    ENV.mm.load_models_gpu([acc])
    folded = sum(object_patches.is_folded(m) for m in unet._modules.values())
    with originals(unet) as swapped:
        pass
    print("%s, latent %d², batch 2; SD Accel's patches: %s; folded blocks: %d, swapped back by the stock path: %d" % (
        OPT.family, LATENT, info.get("patched"), folded, swapped))
    print("%-10s %12s %12s %14s" % ("variant", "enqueue ms", "CPU ms", "to GPU end ms"))
    for v in VARIANTS:
        timed_rows = [r for rnd in rows[v][1:] for r in rnd]
        med = [statistics.median(r[i] for r in timed_rows) for i in range(3)]
        print("%-10s %12.2f %12.2f %14.2f" % (v, *med))


if __name__ == "__main__":
    main()
