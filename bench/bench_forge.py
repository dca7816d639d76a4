#!/usr/bin/env python3
"""Forge's own UNet and patcher: stock Forge vs SD Accel's Forge host, side by side in one process.

Configs `forge_sd15_512_b1`, `forge_sdxl_1024_b1` and `forge_sd15_512_b1_cn` (../shared/BENCH.md): Forge's
`IntegratedUNet2DConditionModel` (backend/nn/unet.py) built with Forge's operations (its own Linear, fp16
weights on the GPU) from the SD1.5 / SDXL UNet configs, random full-size weights built on the GPU, in a
`KModel` in a `UnetPatcher`; 20 Euler steps at CFG 7 through Forge's own sampling code (`sampling_prepare`,
`sampling_function_inner`: cond and uncond batched as Forge batches them, its memory manager loading the
patcher, its `model_function_wrapper` call), same seeds and inputs on both sides.
* stock: the base patcher.
* ours: per sampling run a clone from `hosts.forge.accelerate(base, WebUIOptions())`, as the extension's
  `process_before_every_sampling` makes one (fused kernels, channels_last, CUDA graphs).
* ours without graphs (`ours_eager_its`): the same with `cuda_graph=False`.
* `--eager-pairs` (configs `forge_eager_*`): stock against ours without graphs alone, `--reps` rounds, each
  round running stock, ours on the path SD Accel measured faster (`ours_its`), ours held to the stock modules
  and ours held to the fused ones, in an order rotated per round; ratios paired within a round. Each timed run
  follows an untimed one of the same variant: a user's runs repeat one patcher, where a switch makes Forge
  put one clone's object patches out and the next one's in.
* `sd15_512_b1_cn`: the same with Forge's ControlNet (its cldm control model, random weights, a random hint
  image) applied per run by `apply_controlnet_advanced`, to the base patcher (stock) and to SD Accel's clone
  (ours: Forge's ControlNet script runs after SD Accel's), so its control model runs through SD Accel's hook.
it/s = sampler steps per second, the median of `--reps` timed runs after a warm-up. `psnr_db` is over the
final latent (there is no VAE here; peak = the stock latent's value range; 99 when identical);
`unet_rel_err` over one UNet call (graph replay) against stock on the same input.

Forge's code is not in this repo: `--vendor-from WEBUI` copies the parts this needs (backend/ without its
huggingface/ configs, packages_3rdparty/, the commit) from a Forge tree into vendor/forge (gitignored),
which travels to the GPU machine with Forge's pin of diffusers (0.31.0) as a wheel in vendor/forge/wheels:
bench/gpu_battery.sh's `forge` part installs it into a private folder first (see `diffusers_names`).

GPU:    python3 bench/bench_forge.py --out $OUT           (appends to $OUT/results.jsonl)
Smoke:  python3 bench/bench_forge.py --smoke [--configs sd15_512_b1_cn]   (CPU, tiny UNet, 2 steps, appends nothing)
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.time()
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--forge", default=os.path.join(REPO, "vendor", "forge"), help="folder holding Forge's backend/")
ap.add_argument("--vendor-from", help="copy what this needs from a Forge tree into --forge, then exit")
ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench"))
ap.add_argument("--configs", default="sd15_512_b1,sdxl_1024_b1,sd15_512_b1_cn")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--smoke", action="store_true", help="CPU plumbing check: tiny UNet, 2 steps, no record")
ap.add_argument("--eager-pairs", action="store_true",
                help="stock vs ours without graphs only, in rotated pairs (configs forge_eager_*; see measure_eager)")
ap.add_argument("--profile", action="store_true",
                help="with --eager-pairs: then one run of each variant under torch.profiler (GPU busy ms, launches) "
                     "and cProfile (functions by own time; stock's and held_stock's saved as "
                     "profile_<config>_<variant>.pstats): a diagnosis")
OPT = ap.parse_args()


def vendor(src, dst):
    """Forge's backend (Python files only) and packages_3rdparty, and the commit they came from."""
    shutil.rmtree(os.path.join(dst, "backend"), ignore_errors=True)
    shutil.copytree(os.path.join(src, "backend"), os.path.join(dst, "backend"),
                    ignore=shutil.ignore_patterns("huggingface", "__pycache__", "*.md"))
    shutil.rmtree(os.path.join(dst, "packages_3rdparty"), ignore_errors=True)
    shutil.copytree(os.path.join(src, "packages_3rdparty"), os.path.join(dst, "packages_3rdparty"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    stamp = os.path.join(os.path.dirname(src), "webui.commit")
    with open(os.path.join(dst, "COMMIT"), "w") as f:
        f.write(open(stamp).read() if os.path.isfile(stamp) else "unknown\n")
    print("vendored Forge's backend into", dst)


if OPT.vendor_from:
    vendor(OPT.vendor_from, OPT.forge)
    sys.exit(0)

import torch  # noqa: E402


def diffusers_names():
    """Forge's UNet module imports diffusers' `ConfigMixin`/`register_to_config` (config bookkeeping its
    forward never reads) and its k-prediction module `FlowMatchEulerDiscreteScheduler` and Flux's
    `calculate_shift` (for Flux, not run here). Flux's pipeline module imports transformers, whose pins
    clash with the GPU image's, so that one name always comes from a stand-in; the others from diffusers
    where it imports (Forge's pin, carried as a wheel), else from stand-ins of the same names."""
    flux = types.ModuleType("diffusers.pipelines.flux.pipeline_flux")
    flux.calculate_shift = lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("Flux is not benched"))
    sys.modules["diffusers.pipelines.flux.pipeline_flux"] = flux
    try:
        import diffusers.configuration_utils  # noqa: F401
        from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: F401
        return "diffusers " + diffusers.__version__
    except Exception as e:  # noqa: BLE001 - not installed, or it does not import with this image's packages
        why = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:120])
    for name in [n for n in sys.modules if n == "diffusers" or n.startswith("diffusers.")]:
        if name != flux.__name__:
            del sys.modules[name]
    cu = types.ModuleType("diffusers.configuration_utils")
    cu.ConfigMixin = type("ConfigMixin", (), {})
    cu.register_to_config = lambda init: init
    pkg = types.ModuleType("diffusers")
    pkg.__path__ = []
    pkg.configuration_utils = cu
    pkg.FlowMatchEulerDiscreteScheduler = type("FlowMatchEulerDiscreteScheduler", (), {})
    sys.modules.update({"diffusers": pkg, "diffusers.configuration_utils": cu})
    return "stand-ins of diffusers' names (%s)" % why


DIFFUSERS = diffusers_names()
FORGE = os.path.abspath(OPT.forge)
sys.path[:0] = [FORGE, os.path.join(FORGE, "packages_3rdparty")]   # as Forge's start-up does
_argv, sys.argv = sys.argv, sys.argv[:1] + (["--always-cpu", "--all-in-fp32"] if OPT.smoke else [])
from backend import memory_management, operations  # noqa: E402  (backend.args reads sys.argv at import)
from backend.modules.k_model import KModel  # noqa: E402
from backend.modules.k_prediction import Prediction  # noqa: E402
from backend.nn.unet import IntegratedUNet2DConditionModel  # noqa: E402
from backend.patcher.unet import UnetPatcher  # noqa: E402
from backend.sampling.condition import Condition, ConditionCrossAttn  # noqa: E402
from backend.sampling.sampling_function import sampling_cleanup, sampling_function_inner, sampling_prepare  # noqa: E402
sys.argv = _argv

if "sd_accel" not in sys.modules:   # the repo root as the package `sd_accel`, as tests/conftest.py does
    _pkg = types.ModuleType("sd_accel")
    _pkg.__path__ = [REPO]
    _pkg.__file__ = os.path.join(REPO, "__init__.py")
    sys.modules["sd_accel"] = _pkg
from sd_accel.engine.reports import kernel_report  # noqa: E402
from sd_accel.hosts import forge, forge_controlnet, forge_plan, webui  # noqa: E402

CUDA = torch.cuda.is_available() and not OPT.smoke
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.float16 if CUDA else torch.float32
SD15 = dict(in_channels=4, model_channels=320, out_channels=4, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
            num_heads=8, num_head_channels=-1, use_spatial_transformer=True, transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
            transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], transformer_depth_middle=1,
            context_dim=768, use_linear_in_transformer=False)
SDXL = dict(in_channels=4, model_channels=320, out_channels=4, num_res_blocks=[2, 2, 2], channel_mult=[1, 2, 4],
            num_heads=-1, num_head_channels=64, use_spatial_transformer=True, transformer_depth=[0, 0, 2, 2, 10, 10],
            transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], transformer_depth_middle=10, context_dim=2048,
            use_linear_in_transformer=True, num_classes="sequential", adm_in_channels=2816)
TINY = dict(SD15, model_channels=32, num_res_blocks=[1, 1], channel_mult=[1, 2], num_heads=2, transformer_depth=[1, 1],
            transformer_depth_output=[1, 1, 1, 1], context_dim=32)
CONFIGS = {"sd15_512_b1": (SD15, 64), "sdxl_1024_b1": (SDXL, 128), "sd15_512_b1_cn": (SD15, 64)}


def say(*a):
    print("[forge bench %6.1fs]" % (time.time() - T0), *a, flush=True)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def build(cfg, seed):
    """Forge's UNet from `cfg` with random weights (fan-in scaled; norms near 1), in a KModel in a UnetPatcher."""
    with operations.using_forge_operations(device=DEV, dtype=DTYPE, manual_cast_enabled=False):
        unet = IntegratedUNet2DConditionModel(**cfg)
    randomize(unet, seed)
    unet.storage_dtype = unet.computation_dtype = DTYPE
    unet.load_device, unet.offload_device, unet.initial_device = DEV, torch.device("cpu"), DEV
    kmodel = KModel(model=unet, diffusers_scheduler=None, k_predictor=Prediction(prediction_type="epsilon"), config=None).to(DEV)
    return UnetPatcher(kmodel, load_device=DEV, offload_device=torch.device("cpu"), current_device=DEV)


def build_controlnet(cfg, seed, latent):
    """Forge's ControlNet of `cfg` (its cldm control model with random weights, zero convs included) and a hint
    image for `latent`."""
    from backend.nn.cnets import cldm
    from backend.patcher.controlnet import ControlNet
    with operations.using_forge_operations(device=DEV, dtype=DTYPE, manual_cast_enabled=False):
        # Forge's loader gives the control model the UNet's dtype (modules_forge/supported_controlnet.py): its
        # get_control casts the latent to it
        cm = cldm.ControlNet(hint_channels=3, dtype=DTYPE, **{k: v for k, v in cfg.items() if k != "out_channels"})
    randomize(cm, seed)
    hint = torch.rand(1, 3, latent * 8, latent * 8, generator=torch.Generator().manual_seed(seed)).to(DEV)
    return ControlNet(cm.to(DEV), device=DEV, load_device=DEV), hint


def randomize(module, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    sd = {}
    for name, m in module.named_modules():
        if hasattr(m, "dummy"):   # Forge's Linear: its weight exists once loaded
            sd[name + ".weight"] = torch.randn(m.out_features, m.in_features, generator=g, device=DEV, dtype=DTYPE)
            if not name.endswith(("to_q", "to_k", "to_v")):   # SD checkpoints have no q/k/v biases
                sd[name + ".bias"] = torch.zeros(m.out_features, device=DEV, dtype=DTYPE)
        for pname, p in m.named_parameters(recurse=False):
            if pname != "dummy":
                sd[(name + "." if name else "") + pname] = torch.empty_like(p)
    with torch.no_grad():
        for k, t in sd.items():
            if t.dim() == 1:
                t.copy_((1.0 if k.endswith("weight") else 0.0) + 0.02 * torch.randn(t.shape, generator=g, device=DEV))
            else:
                t.copy_(torch.randn(t.shape, generator=g, device=DEV) / t[0].numel() ** 0.5)
    module.load_state_dict(sd, strict=False)


def inputs(cfg, latent, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, 4, latent, latent, generator=g).to(DEV)

    def cond():
        c = {"c_crossattn": ConditionCrossAttn(torch.randn(1, 77, cfg["context_dim"], generator=g).to(DEV, DTYPE))}
        if cfg.get("adm_in_channels"):
            c["y"] = Condition(torch.randn(1, cfg["adm_in_channels"], generator=g).to(DEV, DTYPE))
        return [{"model_conds": c}]
    return x, cond(), cond()


def sample(patcher, x, cond, uncond, steps):
    """Euler over the predictor's own sigmas, each step through Forge's sampling code (its ControlNets in the
    conds, as Forge's `sampling_function` puts them)."""
    control = patcher.controlnet_linked_list
    if control is not None:
        cond, uncond = ([dict(h, control=control) for h in c] for c in (cond, uncond))
    sampling_prepare(patcher, x)
    sig = patcher.model.predictor.sigmas
    sigmas = torch.cat([sig.flip(0)[torch.linspace(0, len(sig) - 1, steps).long()], sig.new_zeros(1)]).to(DEV)
    x = x * sigmas[0]
    for i in range(steps):
        s = sigmas[i] * x.new_ones([x.shape[0]])
        denoised = sampling_function_inner(patcher.model, x, s, uncond, cond, 7.0, patcher.model_options, seed=0)
        x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    sampling_cleanup(patcher)
    return x


def timed(fn, reps):
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def peak_reset():
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2 ** 30 if CUDA else 0.0


def psnr(ref, out):
    ref, out = ref.float(), out.float()
    mse = float(((ref - out) ** 2).mean())
    span = float(ref.max() - ref.min())
    return 99.0 if mse == 0 else 10 * torch.log10(torch.tensor(span ** 2 / mse)).item()


def one_call(patcher, x, cond, uncond):
    """One UNet call (cond and uncond batched) through the patcher's wrapper when it has one, three times
    (warm-up, capture, replay): the last result."""
    sampling_prepare(patcher, x)
    c = {"c_crossattn": torch.cat([cond[0]["model_conds"]["c_crossattn"].cond,
                                   uncond[0]["model_conds"]["c_crossattn"].cond]), "transformer_options": {}}
    if "y" in cond[0]["model_conds"]:
        c["y"] = torch.cat([cond[0]["model_conds"]["y"].cond, uncond[0]["model_conds"]["y"].cond])
    xx, t = torch.cat([x, x]), torch.full((2,), 5.0, device=DEV)
    wrapper = patcher.model_options.get("model_function_wrapper")
    for _ in range(3):
        if wrapper is None:
            out = patcher.model.apply_model(xx, t, **c)
        else:
            out = wrapper(patcher.model.apply_model, {"input": xx, "timestep": t, "c": dict(c), "cond_or_uncond": [0, 1]})
    sampling_cleanup(patcher)
    return out.float()


def lora_check(base, x, cond, uncond, ref):
    """Forge's LoRA on the modules SD Accel replaces (norms, GEGLU projections), with graphs: ours against
    stock Forge with the same LoRA (two runs: capture, then replay), and once the LoRA is gone, ours against
    plain stock again (graphs captured over the LoRA's weights must not replay)."""
    n = OPT.steps
    g = torch.Generator(device=DEV).manual_seed(5)
    patches = {k: ("diff", (0.3 * torch.randn(p.shape, generator=g, device=DEV).to(p.dtype),))
               for k, p in base.model.named_parameters()
               if k.endswith(("norm1.weight", "in_layers.0.weight", "norm.bias", "ff.net.0.proj.weight"))}
    with_lora = base.clone()
    with_lora.add_patches(filename="bench_lora.safetensors", patches=patches)
    stock_lora = sample(with_lora, x, cond, uncond, n)
    clone, _ = forge.accelerate(with_lora, webui.WebUIOptions())
    ours_lora = [sample(clone, x, cond, uncond, n) for _ in range(2)]
    plain, _ = forge.accelerate(base, webui.WebUIOptions())
    ours_plain = sample(plain, x, cond, uncond, n)
    return {"keys": len(patches), "lora_vs_plain_db": round(psnr(ref, stock_lora), 2),
            "ours_vs_stock_with_lora_db": [round(psnr(stock_lora, o), 2) for o in ours_lora],
            "ours_after_lora_removed_db": round(psnr(ref, ours_plain), 2)}


def time_ours(res, ours, ref):
    """`ours(options)` with the default options as both configs record it: a first run, `--reps` timed runs, the
    kernels they ran, the PSNR of one more run against `ref`. Returns (first run s, timed runs s)."""
    k0 = kernel_report.snapshot()
    peak_reset()
    first = timed(lambda: ours(webui.WebUIOptions()), 1)[0]
    times = timed(lambda: ours(webui.WebUIOptions()), OPT.reps)
    res["ours_its"], res["ours_peak_gib"] = OPT.steps / statistics.median(times), peak_gib()
    res["first_run_s"] = first - statistics.median(times)
    res["kernels"] = kernel_report.summarize(k0, kernel_report.snapshot())
    res["psnr_db"] = psnr(ref, ours(webui.WebUIOptions()))
    return first, times


def measure(name, cfg, latent):
    base = build(cfg, OPT.seed)
    x, cond, uncond = inputs(cfg, latent, OPT.seed)
    n, reps, res = OPT.steps, OPT.reps, {}
    sample(base, x, cond, uncond, n)   # warm-up
    peak_reset()
    times = timed(lambda: sample(base, x, cond, uncond, n), reps)
    res["stock_its"], res["stock_peak_gib"] = n / statistics.median(times), peak_gib()
    ref, ref_call = sample(base, x, cond, uncond, n), one_call(base, x, cond, uncond)
    say(name, "stock run s:", ["%.4f" % s for s in times])

    def ours(options):
        clone, info = forge.accelerate(base, options)   # a clone per sampling run, as the extension makes
        res["info"] = info
        return sample(clone, x, cond, uncond, n)
    first, times = time_ours(res, ours, ref)
    clone, _ = forge.accelerate(base, webui.WebUIOptions())
    res["unet_rel_err"] = float((one_call(clone, x, cond, uncond) - ref_call).norm() / ref_call.norm())
    st = forge_plan.state_of(base.model)
    res["graphs"] = dict(st.graphs.stats) if st.graphs is not None else {}
    blocks = [m for m in st.variants[True].values() if getattr(m, "sdaccel_kind", None) == "resblock"]
    shared = blocks[0].sdaccel_emb_projections.blocks if blocks else []
    res["emb_batched"] = "%d of %d ResBlocks" % (len(shared), len(blocks))
    say(name, "ours  first run s: %.4f" % first, "run s:", ["%.4f" % s for s in times])
    if name == "sd15_512_b1":
        res["lora"] = lora_check(base, x, cond, uncond, ref)
    eager = webui.WebUIOptions(cuda_graph=False)
    ours(eager)
    times = timed(lambda: ours(eager), reps)
    res["ours_eager_its"] = n / statistics.median(times)
    res["eager_psnr_db"] = psnr(ref, ours(eager))
    memory_management.unload_all_models()
    return res


def measure_controlnet(name, cfg, latent):
    """Forge's ControlNet on the UNet: stock (ControlNet applied to the base patcher) against ours (applied to the
    clone SD Accel made, as Forge's ControlNet script runs after SD Accel's), each sampling run a fresh copy."""
    from backend.patcher.controlnet import apply_controlnet_advanced
    base = build(cfg, OPT.seed)
    cn, hint = build_controlnet(cfg, OPT.seed + 7, latent)
    x, cond, uncond = inputs(cfg, latent, OPT.seed)
    n, reps, res = OPT.steps, OPT.reps, {}

    def run(patcher):
        return sample(apply_controlnet_advanced(patcher, cn, hint, 1.0, 0.0, 1.0), x, cond, uncond, n)

    def ours(options):
        clone, info = forge.accelerate(base, options)
        res["info"] = info
        return run(clone)
    plain = sample(base, x, cond, uncond, n)
    run(base)   # warm-up
    peak_reset()
    times = timed(lambda: run(base), reps)
    res["stock_its"], res["stock_peak_gib"] = n / statistics.median(times), peak_gib()
    ref = run(base)
    first, times = time_ours(res, ours, ref)
    res["controlnet_vs_plain_db"] = psnr(plain, ref)
    res["controlnets"] = forge_controlnet.status()
    st = forge_plan.state_of(base.model)
    res["graphs"] = dict(st.graphs.stats) if st.graphs is not None else {}
    say(name, "stock run s:", ["%.4f" % s for s in times], "ControlNet:", json.dumps(res["controlnets"]))
    eager = webui.WebUIOptions(cuda_graph=False)
    ours(eager)
    times = timed(lambda: ours(eager), reps)
    res["ours_eager_its"] = n / statistics.median(times)
    res["eager_psnr_db"] = psnr(ref, ours(eager))
    res["unet_rel_err"] = None
    res["emb_batched"] = "-"
    memory_management.unload_all_models()
    return res


def measure_eager(name, cfg, latent):
    """See `--eager-pairs` in the module doc. Returns the record's fields."""
    from sd_accel.engine.graphs import eager
    base = build(cfg, OPT.seed)
    x, cond, uncond = inputs(cfg, latent, OPT.seed)
    n = OPT.steps
    if name.endswith("_cn"):
        from backend.patcher.controlnet import apply_controlnet_advanced
        cn, hint = build_controlnet(cfg, OPT.seed + 7, latent)

        def run(patcher):
            return sample(apply_controlnet_advanced(patcher, cn, hint, 1.0, 0.0, 1.0), x, cond, uncond, n)
    else:
        def run(patcher):
            return sample(patcher, x, cond, uncond, n)
    off = webui.WebUIOptions(cuda_graph=False)

    def ours(held):
        eager.FORCED_PATH = held
        try:
            return run(forge.accelerate(base, off)[0])
        finally:
            eager.FORCED_PATH = None
    variants = {"stock": lambda: run(base), "ours": lambda: ours(None),
                "held_stock": lambda: ours("stock"), "held_fused": lambda: ours("fused")}
    ref = run(base)
    for _ in range(2):   # warm-up: kernels compiled, each key's path measured and chosen
        for fn in variants.values():
            fn()
    times = {k: [] for k in variants}
    order = list(variants)
    for i in range(OPT.reps):
        for k in order[i % len(order):] + order[:i % len(order)]:
            variants[k]()   # untimed: Forge loads this variant's patcher (the previous variant's goes out)
            sync()
            t0 = time.perf_counter()
            variants[k]()
            sync()
            times[k].append(time.perf_counter() - t0)
    st = forge_plan.state_of(base.model)
    res = {"stock_its": n / statistics.median(times["stock"]), "ours_its": n / statistics.median(times["ours"]),
           "psnr_db": psnr(ref, ours(None)), "paths": st.eager_paths.choices() if st.eager_paths else {}}
    for k in ("ours", "held_stock", "held_fused"):
        ratios = sorted(s / o for s, o in zip(times["stock"], times[k]))
        res[k + "_ratio"] = (statistics.median(ratios), ratios[0], ratios[-1])
    say(name, "run s:", json.dumps({k: ["%.4f" % t for t in v] for k, v in times.items()}))
    if OPT.profile:
        for k, fn in variants.items():
            profile_run(name, k, fn)
    memory_management.unload_all_models()
    return res


def profile_run(name, variant, fn):
    """One run of `fn` under torch.profiler (the GPU's busy time and kernel launches: bound by the host or the
    GPU?), then one under cProfile (where the host's time goes), printed."""
    import cProfile
    import io
    import pstats
    fn()   # this variant's patcher loaded
    if CUDA:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        on_gpu = [e for e in prof.key_averages() if e.device_time_total and "CUDA" in str(e.device_type)]
        say(name, variant, "GPU busy %.1f ms, %d kernel launches" % (
            sum(e.device_time_total for e in on_gpu) / 1000.0, sum(e.count for e in on_gpu)))
    pr = cProfile.Profile()
    sync()
    t0 = time.perf_counter()
    pr.enable()
    fn()
    sync()
    pr.disable()
    wall = time.perf_counter() - t0
    # the pair that differs by host time alone (a device call brings few files back)
    if variant in ("stock", "held_stock"):
        os.makedirs(OPT.out, exist_ok=True)
        pr.dump_stats(os.path.join(OPT.out, "profile_%s_%s.pstats" % (name, variant)))
    text = io.StringIO()
    st = pstats.Stats(pr, stream=text)
    st.sort_stats("tottime").print_stats(14)
    calls = sum(v[1] for v in st.stats.values())
    say(name, variant, "under cProfile %.3f s, %d Python calls; by own time:\n%s" % (
        wall, calls, "\n".join(text.getvalue().splitlines()[-16:])))


def record_eager(name, r, env):
    med, lo, hi = r["ours_ratio"]
    return dict(env, date=datetime.date.today().isoformat(), config="forge_eager_" + name, steps=OPT.steps,
                sampler="euler", scheduler="predictor sigmas, uniform", cfg=7.0, reps=OPT.reps,
                stock_its=round(r["stock_its"], 2), ours_its=round(r["ours_its"], 2),
                paired_ratio_median=round(med, 3), paired_ratio_min=round(lo, 3), paired_ratio_max=round(hi, 3),
                held_stock_ratio_median=round(r["held_stock_ratio"][0], 3),
                held_fused_ratio_median=round(r["held_fused_ratio"][0], 3), psnr_db=round(r["psnr_db"], 2),
                notes="Forge's UNet and sampling code, random weights; SD Accel with CUDA graphs off, a clone per run as "
                      "the extension makes; ratios = ours' it/s over stock's in the same round, rounds rotated; "
                      "held_*: every call held to that path; paths chosen per key: %s" % json.dumps(r["paths"]))


def record(name, r, env):
    k = r["kernels"]
    ran = ", ".join("%s x%d" % (op, e["fused"]) for op, e in sorted(k.items()) if e["fused"])
    fell = {op: e["reasons"] for op, e in k.items() if e["fallback"]}
    info = r["info"]
    notes = ("Forge's UNet and sampling code, random weights; psnr over the final latent; patched %s (%s); "
             "timestep projections in one GEMM: %s; wrapper %s; ran: %s; fell back: %s; graphs: %s; ours without graphs "
             "%.2f it/s (PSNR %.1f dB)%s" % (
                 json.dumps(info["counts"]), "SiLU folded" if info["fold_silu"] else "SiLU not folded",
                 r["emb_batched"], info["wrapper"], ran or "-", json.dumps(fell), json.dumps(r["graphs"]), r["ours_eager_its"],
                 r["eager_psnr_db"], "; Forge LoRA check %s" % json.dumps(r["lora"]) if "lora" in r else ""))
    if "controlnets" in r:
        notes += "; Forge's ControlNet on every step (%.1f dB from the image without it): %s" % (
            r["controlnet_vs_plain_db"], json.dumps(r["controlnets"]))
    return dict(env, date=datetime.date.today().isoformat(), config="forge_" + name, steps=OPT.steps,
                sampler="euler", scheduler="predictor sigmas, uniform", cfg=7.0,
                stock_its=round(r["stock_its"], 2), ours_its=round(r["ours_its"], 2),
                speedup=round(r["ours_its"] / r["stock_its"], 3), first_run_s=round(r["first_run_s"], 2),
                stock_peak_gib=round(r["stock_peak_gib"], 3), ours_peak_gib=round(r["ours_peak_gib"], 3),
                psnr_db=round(r["psnr_db"], 2), unet_rel_err=r["unet_rel_err"],
                ours_eager_its=round(r["ours_eager_its"], 2), graphs=r["graphs"].get("replays", 0) > 0, notes=notes)


def versions():
    v = {"gpu": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__, "comfyui": None}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    stamp = os.path.join(FORGE, "COMMIT")
    v["forge"] = open(stamp).read().strip() if os.path.isfile(stamp) else "unknown"
    v["diffusers"] = DIFFUSERS
    return v


def main():
    if OPT.reps < 3:
        ap.error("--reps must be at least 3")
    if OPT.smoke:
        OPT.steps = min(OPT.steps, 2)
    env = versions()
    say("ENV", json.dumps(env), "device:", DEV)
    rows = []
    for name in filter(None, OPT.configs.split(",")):
        cfg, latent = (TINY, 8) if OPT.smoke else CONFIGS[name]
        with torch.no_grad():
            if OPT.eager_pairs:
                r = measure_eager(name, cfg, latent)
            else:
                r = (measure_controlnet if name.endswith("_cn") else measure)(name, cfg, latent)
        rec = (record_eager if OPT.eager_pairs else record)(name, r, env)
        rows.append(rec)
        say("RESULT", json.dumps(rec))
        if CUDA:
            os.makedirs(OPT.out, exist_ok=True)
            with open(os.path.join(OPT.out, "results.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
        if OPT.smoke:
            break
    if not CUDA:
        say("smoke/CPU run: nothing recorded")
    if OPT.eager_pairs:
        print("%-28s %9s %9s %8s %11s %11s %11s %7s" % ("config", "stock it/s", "ours it/s", "paired", "min-max",
                                                       "held stock", "held fused", "PSNR"))
        for r in rows:
            print("%-28s %9.2f %9.2f %8.3f %5.2f-%5.2f %11.3f %11.3f %7.2f" % (
                r["config"], r["stock_its"], r["ours_its"], r["paired_ratio_median"], r["paired_ratio_min"],
                r["paired_ratio_max"], r["held_stock_ratio_median"], r["held_fused_ratio_median"], r["psnr_db"]))
        return
    print("%-22s %9s %9s %7s %9s %8s %10s" % ("config", "stock it/s", "ours it/s", "speedup", "eager it/s",
                                             "PSNR", "rel err"))
    for r in rows:
        err = "-" if r["unet_rel_err"] is None else "%.2e" % r["unet_rel_err"]
        print("%-22s %9.2f %9.2f %6.2fx %9.2f %8.2f %10s" % (r["config"], r["stock_its"], r["ours_its"],
                                                           r["speedup"], r["ours_eager_its"], r["psnr_db"], err))


if __name__ == "__main__":
    main()
