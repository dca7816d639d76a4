#!/usr/bin/env python3
"""A1111's ldm UNet forward: stock eager vs SD Accel's A1111 host path, side by side in one process.

Config `a1111_ldm_sd15_512_b1` (../shared/BENCH.md): the ldm `UNetModel` A1111 v1.10 runs for SD1.x
(PyPI's stable-diffusion-sdkit==2.1.5, installed --no-deps; the UNet imports only torch, numpy,
einops and Pillow), SD1.5 config, 512² -> latent 64x64, CFG batch 2, random full-size weights built on
the GPU. The UNet is driven the way A1111 drives it with its defaults: fp16 weights (`model.half()`),
`use_fp16=False` and `use_checkpoint=False` in the config, every step under `torch.autocast("cuda")`
and `torch.no_grad()`, TF32 on, the native CUDA allocator, and a class-level `CrossAttention.forward`
standing in for A1111's attention optimisation (`--attention`, below).

* stock: `unet(x, t, context=c)`.
* ours: `hosts.a1111.apply(unet, A1111Options())` (fused GroupNorm+SiLU / LayerNorm / GEGLU swapped in
  as leaves, channels_last conv weights), then each step through `hosts.a1111_graph_route.graph_forward(unet,
  UNetModel.forward, ...)`, the call A1111's `sd_unet` hook makes ("SD Unet" = Automatic), with
  `new_sampling_run` once per run of steps as the extension's `process` callback does.
* ours without graphs (`ours_eager_its`): the same patches, the UNet called directly ("SD Unet" = None).
* with --fp8, ours with the LOSSY `precision` fp8 setting too (hosts/a1111_fp8.py: the feed-forward GEGLU
  projections in FP8), after ours in fp16, through the same graph call: a second record per attention,
  `<config>_fp8`, with `precision` "fp8", `speedup_vs_fp16` and its `unet_rel_err` against stock.

it/s = UNet forwards per second (one forward = one CFG-batch-2 denoising step; the sampler's own
arithmetic is not timed): the median of `--reps` timed runs of `--steps` forwards after a warm-up.
`first_run_s`: the first accelerated run (Triton JIT on a cold cache for the first config, graph
warm-up and capture) minus a warm one. Peak VRAM: `torch.cuda.max_memory_allocated` over the runs of
each side (ours includes the graph pool). `unet_rel_err`: relative L2 error of one forward, ours (graph
replay) vs stock, same input.

--attention (comma list; each is one config):
  sdp       A1111's `sdp` optimisation (--opt-sdp-attention): torch's scaled_dot_product_attention ->
            `a1111_ldm_sd15_512_b1`, the config the ComfyUI path is compared with (ComfyUI uses SDPA too)
  doggettx  what A1111's "Automatic" picks with no flag on CUDA (Doggettx, priority 90 over sdp-no-mem's
            80): fp16 einsum attention, unsliced (it slices only when VRAM is short, never at 512² on
            an H200; its per-call free-VRAM query is left out) -> `a1111_ldm_sd15_512_b1_doggettx`
  ldm       the package's own CrossAttention (fp32 scores, no A1111 hijack) -> `..._ldmattn`

GPU:    python3 bench/bench_a1111_ldm.py --out $OUT          (appends to $OUT/results.jsonl)
Smoke:  python3 bench/bench_a1111_ldm.py --smoke             (CPU, tiny UNet, appends nothing)
"""
import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
import traceback
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.time()

# SD1.5's unet_config (v1-inference.yaml) as A1111 builds it; `image_size` is unused by the forward.
SD15 = dict(image_size=32, in_channels=4, out_channels=4, model_channels=320, attention_resolutions=[4, 2, 1],
            num_res_blocks=2, channel_mult=[1, 2, 4, 4], num_heads=8, use_spatial_transformer=True,
            transformer_depth=1, context_dim=768, use_checkpoint=False, legacy=False)
# smoke: every op SD Accel fuses, two levels, small enough for a CPU
TINY = dict(SD15, model_channels=32, attention_resolutions=[1, 2], num_res_blocks=1, channel_mult=[1, 2],
            num_heads=2, context_dim=32)

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench"),
                help="folder whose results.jsonl gets one line per config (GPU runs only)")
ap.add_argument("--attention", default="sdp,doggettx", help="comma list of sdp, doggettx, ldm")
ap.add_argument("--steps", type=int, default=20, help="forwards per timed run")
ap.add_argument("--reps", type=int, default=5, help="timed runs per side (median reported; at least 3)")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--smoke", action="store_true", help="CPU plumbing check: tiny UNet, 2 forwards a run, no record")
ap.add_argument("--interpret", action="store_true",
                help="with --smoke: the Triton kernels in Triton's CPU interpreter instead of the torch fallback "
                     "(slow: ~20 s a forward, minutes in all)")
ap.add_argument("--fp8", action="store_true", help="also measure precision fp8 (LOSSY; sm_89/sm_90 GPUs)")
OPT = ap.parse_args()
if OPT.smoke and OPT.interpret:
    os.environ["TRITON_INTERPRET"] = "1"   # read by Triton at its first import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if "sd_accel" not in sys.modules:   # the repo root as the package `sd_accel`, as tests/conftest.py does
    _pkg = types.ModuleType("sd_accel")
    _pkg.__path__ = [REPO]
    _pkg.__file__ = os.path.join(REPO, "__init__.py")
    sys.modules["sd_accel"] = _pkg
from sd_accel.engine.reports import kernel_report  # noqa: E402
from sd_accel.hosts import a1111, a1111_graph_route  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "dev"))
from ldm_without_omegaconf import provide_list_config  # noqa: E402

provide_list_config()
import ldm.modules.attention as ldm_attention  # noqa: E402
from ldm.modules.diffusionmodules.openaimodel import UNetModel  # noqa: E402

CUDA = torch.cuda.is_available() and not OPT.smoke
DEV = "cuda" if CUDA else "cpu"


def say(*a):
    print("[a1111 bench %6.1fs]" % (time.time() - T0), *a, flush=True)


def sync():
    if CUDA:
        torch.cuda.synchronize()


# -- A1111's attention optimisations, as class-level CrossAttention.forward (what sd_hijack does) ---

def _split_heads(t, h):
    """(b, n, h*d) -> (b, h, n, d)"""
    b, n, _ = t.shape
    return t.view(b, n, h, -1).transpose(1, 2)


def _merge_heads(t):
    """(b, h, n, d) -> (b, n, h*d)"""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def attention_sdp(self, x, context=None, mask=None, **kwargs):
    context = x if context is None else context
    q, k, v = (_split_heads(t, self.heads) for t in (self.to_q(x), self.to_k(context), self.to_v(context)))
    return self.to_out(_merge_heads(F.scaled_dot_product_attention(q, k, v)))


def attention_einsum(self, x, context=None, mask=None, **kwargs):
    context = x if context is None else context
    h = self.heads
    q, k, v = (_split_heads(t, h) for t in (self.to_q(x), self.to_k(context) * self.scale, self.to_v(context)))
    b, _, n, d = q.shape
    q, k, v = (t.reshape(b * h, t.shape[2], d) for t in (q, k, v))
    s = torch.einsum("bid,bjd->bij", q, k).softmax(dim=-1, dtype=q.dtype)
    r = torch.einsum("bij,bjd->bid", s, v)
    return self.to_out(_merge_heads(r.view(b, h, n, d)))


ORIGINAL_ATTENTION = ldm_attention.CrossAttention.forward
ATTENTION = {"sdp": attention_sdp, "doggettx": attention_einsum, "ldm": ORIGINAL_ATTENTION}
SUFFIX = {"sdp": "", "doggettx": "_doggettx", "ldm": "_ldmattn"}


# -- model and inputs -------------------------------------------------------------------------------

def build_unet(cfg, seed):
    """Random weights, built on the device; ldm's zero-initialised output convs get random values too
    so every block contributes to the output (and to the error measured)."""
    torch.manual_seed(seed)
    with torch.device(DEV):
        unet = UNetModel(**cfg)
    unet.eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn_like(p))
            elif not p.any():
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    if CUDA:
        unet.half()   # A1111's default precision: fp16 weights, autocast, the config's use_fp16=False
    return unet


def make_inputs(cfg, latent, seed):
    """A CFG batch as k-diffusion hands it to the UNet: [x, x], [t, t], [uncond, cond]."""
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    x = torch.randn(1, cfg["in_channels"], latent, latent, generator=g, device=DEV).repeat(2, 1, 1, 1)
    t = torch.full((2,), 481.0, device=DEV)
    ctx = torch.randn(2, 77 if CUDA else 5, cfg["context_dim"], generator=g, device=DEV)
    return x, t, ctx


def autocast():
    return torch.autocast("cuda", dtype=torch.float16) if CUDA else contextlib.nullcontext()


def timed_runs(step, n, reps, holder):
    """Seconds for each of `reps` runs of `n` calls of `step`."""
    out = []
    for _ in range(reps):
        a1111.new_sampling_run(holder)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def peak_reset():
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2 ** 30 if CUDA else 0.0


def rel_err(ref, out):
    ref, out = ref.float(), out.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def measure(unet, inputs, attention, warm):
    """One config: stock, ours (graphs), ours (no graphs), then everything removed."""
    ldm_attention.CrossAttention.forward = ATTENTION[attention]
    holder = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=unet))
    x, t, ctx = inputs
    n, reps = OPT.steps, OPT.reps
    res = {}

    def stock():
        return unet(x, t, context=ctx)

    def ours():
        return a1111_graph_route.graph_forward(unet, UNetModel.forward, x, t, ctx)

    # stock
    for _ in range(warm):
        stock()
    peak_reset()
    times = timed_runs(stock, n, reps, holder)
    res["stock_its"] = n / statistics.median(times)
    res["stock_peak_gib"] = peak_gib()
    ref = stock().clone()
    say("stock", attention, "run s:", ["%.4f" % s for s in times])

    # ours: fused kernels + channels_last + CUDA graphs (A1111Options' defaults)
    res["apply"] = a1111.apply(unet, a1111.A1111Options())
    before, g0 = kernel_report.snapshot(), dict(a1111.status(unet)["graphs"])
    peak_reset()
    first = timed_runs(ours, n, 1, holder)[0]
    times = timed_runs(ours, n, reps, holder)
    res["ours_its"] = n / statistics.median(times)
    res["first_run_s"] = first - statistics.median(times)
    res["ours_peak_gib"] = peak_gib()
    res["unet_rel_err"] = rel_err(ref, ours())
    res["kernels"] = kernel_report.summarize(before, kernel_report.snapshot())
    g1 = a1111.status(unet)["graphs"]   # this config's share of the UNet's cumulative graph counts
    res["graphs"] = {k: (v - g0.get(k, 0) if isinstance(v, int) else v) for k, v in g1.items()}
    say("ours  ", attention, "first run s: %.4f" % first, "run s:", ["%.4f" % s for s in times])

    if OPT.fp8:
        s8 = a1111.apply(unet, a1111.A1111Options(precision="fp8"))
        before = kernel_report.snapshot()
        peak_reset()
        first = timed_runs(ours, n, 1, holder)[0]    # FP8 copies made, graphs captured again
        times = timed_runs(ours, n, reps, holder)
        res["fp8"] = {"its": n / statistics.median(times), "first_run_s": first - statistics.median(times),
                      "peak_gib": peak_gib(), "rel_err": rel_err(ref, ours()), "precision": s8["precision"],
                      "reasons": s8["reasons"], "fp8_linear": s8["counts"].get("fp8_linear", 0),
                      "kernels": kernel_report.summarize(before, kernel_report.snapshot())}
        say("ours fp8", attention, "precision", s8["precision"], s8["reasons"], "run s:", ["%.4f" % s for s in times])

    # ours without graphs: the same patches, the UNet called directly ("SD Unet" = None)
    a1111.apply(unet, a1111.A1111Options(cuda_graph=False))
    for _ in range(warm):
        stock()
    times = timed_runs(stock, n, reps, holder)
    res["ours_eager_its"] = n / statistics.median(times)
    res["eager_rel_err"] = rel_err(ref, stock())

    a1111.remove(unet)
    s = a1111.status(unet)
    res["removed_ok"] = s["patched"] == 0 and not s["channels_last"] and s["state_dict_keys_unchanged"]
    ldm_attention.CrossAttention.forward = ORIGINAL_ATTENTION
    return res


def versions():
    from importlib import metadata
    v = {"gpu": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    v["comfyui"] = None
    try:
        v["ldm"] = "stable-diffusion-sdkit " + metadata.version("stable-diffusion-sdkit")
    except metadata.PackageNotFoundError:
        v["ldm"] = "unknown"
    return v


def main():
    if OPT.reps < 3:
        ap.error("--reps must be at least 3")
    if CUDA:
        torch.backends.cuda.matmul.allow_tf32 = True   # A1111's devices.enable_tf32
        torch.backends.cudnn.allow_tf32 = True
    cfg, latent, warm = (TINY, 8, 1) if OPT.smoke else (SD15, 64, 3)
    if OPT.smoke:
        OPT.steps = min(OPT.steps, 2)
    env = versions()
    alloc = torch.cuda.get_allocator_backend() if CUDA else "n/a"
    say("ENV", json.dumps(env), "allocator:", alloc, "device:", DEV)
    t_build = time.time()
    unet = build_unet(cfg, OPT.seed)
    sync()
    say("UNet built on %s in %.1f s: %.0fM parameters" % (DEV, time.time() - t_build,
                                                           sum(p.numel() for p in unet.parameters()) / 1e6))
    inputs = make_inputs(cfg, latent, OPT.seed)
    rows = []
    for i, attention in enumerate(filter(None, OPT.attention.split(","))):
        config = "a1111_ldm_sd15_512_b1" + SUFFIX[attention]
        try:
            with torch.no_grad(), autocast():
                r = measure(unet, inputs, attention, warm)
        except Exception:  # noqa: BLE001 - keep the other configs
            ldm_attention.CrossAttention.forward = ORIGINAL_ATTENTION
            say("ERROR", config, traceback.format_exc())
            continue
        k = r["kernels"]
        ran = ", ".join("%s x%d" % (op, e["fused"]) for op, e in sorted(k.items()) if e["fused"])
        fell = {op: e["reasons"] for op, e in k.items() if e["fallback"]}
        notes = ("attention %s; batch 2 (CFG), one it = one UNet forward; ran: %s; fell back: %s; graphs: %s; "
                 "patched: %s; ours without graphs %.2f it/s (rel. err %.1e); removed cleanly: %s%s" % (
                     attention, ran or "-", json.dumps(fell), json.dumps(r["graphs"]), json.dumps(r["apply"]["counts"]),
                     r["ours_eager_its"], r["eager_rel_err"], r["removed_ok"],
                     "; first run includes Triton JIT (cold cache)" if i == 0 else ""))
        rec = dict(env, date=datetime.date.today().isoformat(), config=config, steps=OPT.steps, sampler=None,
                   scheduler=None, cfg=None, stock_its=round(r["stock_its"], 2), ours_its=round(r["ours_its"], 2),
                   speedup=round(r["ours_its"] / r["stock_its"], 3), first_run_s=round(r["first_run_s"], 2),
                   stock_peak_gib=round(r["stock_peak_gib"], 3), ours_peak_gib=round(r["ours_peak_gib"], 3),
                   unet_rel_err=r["unet_rel_err"], ours_eager_its=round(r["ours_eager_its"], 2),
                   allocator=alloc, attention=attention, notes=notes)
        recs = [rec]
        if "fp8" in r:
            f8 = r["fp8"]
            ran8 = ", ".join("%s x%d" % (op, e["fused"]) for op, e in sorted(f8["kernels"].items()) if e["fused"])
            fell8 = {op: e["reasons"] for op, e in f8["kernels"].items() if e["fallback"]}
            recs.append(dict(rec, config=config + "_fp8", precision=f8["precision"], ours_its=round(f8["its"], 2),
                             speedup=round(f8["its"] / r["stock_its"], 3),
                             speedup_vs_fp16=round(f8["its"] / r["ours_its"], 3),
                             first_run_s=round(f8["first_run_s"], 2), ours_peak_gib=round(f8["peak_gib"], 3),
                             unet_rel_err=f8["rel_err"], ours_eager_its=None,
                             notes="LOSSY: precision fp8 (%d FP8 Linear forwards; not used: %s), ours through the "
                                   "graph call after ours in fp16, same process and input; attention %s; ran: %s; "
                                   "fell back: %s" % (f8["fp8_linear"], json.dumps(f8["reasons"]), attention,
                                                      ran8 or "-", json.dumps(fell8))))
        for rec in recs:
            rows.append(rec)
            say("RESULT", json.dumps(rec))
            if CUDA:
                os.makedirs(OPT.out, exist_ok=True)
                with open(os.path.join(OPT.out, "results.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
    if not CUDA:
        say("smoke/CPU run: nothing recorded")
    print("%-32s %9s %9s %7s %10s %8s %8s %8s %9s" % (
        "config", "stock it/s", "ours it/s", "x", "no-graph", "first s", "peak st", "peak us", "unet err"))
    for r in rows:
        print("%-32s %9.2f %9.2f %7.2f %10.2f %8.2f %8.3f %8.3f %9.2e" % (
            r["config"], r["stock_its"], r["ours_its"], r["speedup"], r["ours_eager_its"] or 0, r["first_run_s"],
            r["stock_peak_gib"], r["ours_peak_gib"], r["unet_rel_err"]))
    if len(rows) < len(list(filter(None, OPT.attention.split(",")))) * (2 if OPT.fp8 else 1):
        sys.exit(1)


if __name__ == "__main__":
    main()
