"""What bench_unet.py and bench_controlnet.py share: ComfyUI booted in-process in main.py's order (so
its default cudaMallocAsync allocator is in force), this repo registered as the package `sd_accel` the
way ComfyUI loads it from custom_nodes, and the measuring helpers."""
import argparse
import datetime
import json
import os
import shlex
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.time()


def add_common_args(ap: argparse.ArgumentParser, deadline=540.0):
    ap.add_argument("--comfy-dir", default=os.path.join(REPO, "vendor", "ComfyUI"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    ap.add_argument("--work", default="/tmp/sdaccel_bench", help="where the random checkpoints are written")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=deadline, help="seconds; later configs are skipped past it")
    ap.add_argument("--comfy-args", default="", help="arguments for ComfyUI's own parser, e.g. --disable-cuda-malloc")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check: tiny models, 64 px, --cpu")


def boot(opt, model_folders=("checkpoints",)):
    """Imports ComfyUI as main.py does (args, cuda_malloc, then torch); returns the modules benches use."""
    os.makedirs(opt.out, exist_ok=True)
    if opt.smoke:
        opt.comfy_args += " --cpu"
    sys.argv = [sys.argv[0]] + shlex.split(opt.comfy_args)
    sys.path.insert(0, os.path.abspath(opt.comfy_dir))
    sys.path.insert(0, os.path.join(REPO, "dev"))
    import comfy.options
    comfy.options.enable_args_parsing()
    import cuda_malloc  # noqa: F401  sets ComfyUI's default allocator before torch initialises CUDA
    import torch
    import folder_paths
    import comfy.utils
    import comfy.model_management as mm
    import nodes
    import fixtures
    pkg = types.ModuleType("sd_accel")
    pkg.__path__ = [REPO]
    sys.modules["sd_accel"] = pkg
    comfy.utils.set_progress_bar_enabled(False)
    for kind in model_folders:
        path = os.path.join(opt.work, kind)
        os.makedirs(path, exist_ok=True)
        try:
            folder_paths.add_model_folder_path(kind, path, is_default=True)
        except TypeError:   # ComfyUI 2024: no is_default
            folder_paths.add_model_folder_path(kind, path)
    cuda = torch.cuda.is_available() and not opt.smoke
    return types.SimpleNamespace(torch=torch, nodes=nodes, mm=mm, fixtures=fixtures, cuda=cuda,
                                 dev="cuda" if cuda else "cpu")


def say(*a):
    print("[bench %6.1fs]" % (time.time() - T0), *a, flush=True)


def sync(env):
    if env.cuda:
        env.torch.cuda.synchronize()


def median_ms(env, fn, reps):
    """ms of `fn()` with the device synchronised around it: one warm-up call, then the median of `reps`."""
    import statistics
    fn()
    sync(env)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(env)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def psnr(a, b):
    import torch
    mse = float(((a - b) ** 2).mean())
    return 99.0 if mse == 0 else float(10 * torch.log10(torch.tensor(1.0 / mse)))


def versions(env, comfy_dir):
    torch = env.torch
    v = {"gpu": torch.cuda.get_device_name() if env.cuda else "cpu", "torch": torch.__version__}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    cf = os.path.join(comfy_dir, ".comfy_commit")
    v["comfyui"] = open(cf).read().strip()[:12] if os.path.exists(cf) else "unknown"
    try:
        import comfyui_version
        v["comfyui"] += " (%s)" % comfyui_version.__version__
    except ImportError:
        pass
    return v


POS, NEG = "a photograph of an astronaut riding a horse", "blurry"


def run_graph(env, model, clip, vae, size, batch, seed, sampler, steps, add_to_conds=None, decoder="stock",
              accel=None):
    """One execution of the whole graph (encode, latent, KSampler or Accelerated KSampler, decode),
    as ComfyUI's executor runs it: times, peak VRAM over sampling, the image and our node's report.
    `add_to_conds(pos, neg) -> (pos, neg)` inserts extra conditioning nodes (e.g. ControlNets). decoder: "stock"
    (VAE Decode) or "ours" (VAE Decode (SD Accel), its defaults: planned decode, cache released after).
    `accel`: Accelerated KSampler inputs other than its defaults, e.g. {"cuda_graph": False}."""
    import time as _t
    torch, nodes = env.torch, env.nodes
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    with torch.inference_mode():
        sync(env)
        t0 = _t.perf_counter()
        pos = nodes.CLIPTextEncode().encode(clip, POS)[0]
        neg = nodes.CLIPTextEncode().encode(clip, NEG)[0]
        if add_to_conds is not None:
            pos, neg = add_to_conds(pos, neg)
        lat = nodes.EmptyLatentImage().generate(size, size, batch)[0]
        sync(env)
        if env.cuda:
            torch.cuda.reset_peak_memory_stats()
        t1 = _t.perf_counter()
        report = line = None
        if sampler == "ours":
            res = SDAccelKSampler().sample(model, seed, steps, 7.0, "euler", "normal", pos, neg, lat, **(accel or {}))
            out, report, line = res["result"][0], res["ui"]["sdaccel_report"][0], res["ui"]["text"][0]
        else:
            out = nodes.KSampler().sample(model, seed, steps, 7.0, "euler", "normal", pos, neg, lat)[0]
        sync(env)
        t2 = _t.perf_counter()
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if env.cuda else 0.0
        if decoder == "ours":
            from sd_accel.nodes.vae_nodes import SDAccelVAEDecode
            img = SDAccelVAEDecode().decode(out, vae)["result"][0]
        else:
            img = nodes.VAEDecode().decode(vae, out)[0]
        sync(env)
        t3 = _t.perf_counter()
    return {"sample_s": t2 - t1, "e2e_s": t3 - t0, "peak_gib": peak, "img": img.float().cpu(), "report": report,
            "line": line, "latent": out["samples"].float().cpu()}


def cuda_kernel_times(env, run_once):
    """(GPU ms per CUDA kernel name, launches per name) over `run_once()` under torch's profiler; empty on a CPU."""
    import collections
    times, counts = collections.Counter(), collections.Counter()
    if not env.cuda:
        return times, counts
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_once()
    for e in prof.key_averages():
        if e.device_type == env.torch.autograd.DeviceType.CUDA:
            times[e.key[:100]] += e.device_time_total / 1000.0
            counts[e.key[:100]] += e.count
    return times, counts


def load_family(env, opt, kind, loaded):
    """(model, clip, vae) of the random `kind` ("sd15"/"sdxl") checkpoint, built once under opt.work; one
    model family resident at a time, as a user's server would (`loaded` is the caller's cache)."""
    if kind not in loaded:
        loaded.clear()
        env.mm.unload_all_models()
        env.mm.soft_empty_cache()
        name = "random_%s_fp16.safetensors" % kind
        path = os.path.join(opt.work, "checkpoints", name)
        env.fixtures.ensure(path, env.fixtures.build_checkpoint, opt.comfy_dir, kind,
                            "tiny" if opt.smoke else "sd15", path, 1234)
        with env.torch.inference_mode():
            loaded[kind] = env.nodes.CheckpointLoaderSimple().load_checkpoint(name)[:3]
    return loaded[kind]


def random_controlnet(env, opt, kind, preset):
    """The random `kind` ControlNet of `preset` (built once under opt.work/controlnet, seed 99), loaded as the
    ControlNetLoader node loads it."""
    name = "random_cn_%s_%s_fp16.safetensors" % (kind, preset)
    path = os.path.join(opt.work, "controlnet", name)
    env.fixtures.ensure(path, env.fixtures.build_controlnet, opt.comfy_dir, preset, path, seed=99, kind=kind)
    with env.torch.inference_mode():
        return env.nodes.ControlNetLoader().load_controlnet(name)[0]


def pair_record(env_info, opt, tag, stock, ours):
    """The BENCH.md fields of one config from two `measure` results (stock and ours)."""
    return dict(env_info, date=datetime.date.today().isoformat(), config=tag, steps=opt.steps, sampler="euler",
                scheduler="normal", cfg=7.0, stock_its=round(stock["its"], 2), ours_its=round(ours["its"], 2),
                speedup=round(ours["its"] / stock["its"], 3),
                first_run_s=round(ours["first_s"] - ours["sample_s"], 2),
                stock_e2e_s=round(stock["e2e_s"], 3), ours_e2e_s=round(ours["e2e_s"], 3),
                stock_peak_gib=round(stock["peak_gib"], 3), ours_peak_gib=round(ours["peak_gib"], 3),
                psnr_db=round(psnr(stock["img"], ours["img"]), 2))


def host_memory(env, patcher, caches=()):
    """Host memory held for a model's UNet weights after a run (GiB): `unet_host` = its tensors' distinct host
    storages plus the buffers in `caches` (dicts of host buffers, e.g. the VRAM Pool's pinned caches) that no
    tensor shares, `pinned` = page-locked bytes (torch's pinned allocator: its blocks, in use or cached),
    `rss` = the process's resident set."""
    torch = env.torch
    seen = {}
    unet = patcher.model.diffusion_model
    tensors = [t for t in list(unet.parameters()) + list(unet.buffers()) if t.device.type == "cpu"]
    for c in caches:
        tensors += [t for t in c.values() if torch.is_tensor(t)]
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    pinned = 0
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if env.cuda and stats is not None:
        pinned = stats().get("allocated_bytes.current", 0)
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    gib = float(1 << 30)
    return {"unet_host": sum(seen.values()) / gib, "pinned": pinned / gib, "rss": rss / gib}


def append_record(opt, rec):
    """One JSON line to <out>/results.jsonl, and the RESULT line of the log."""
    with open(os.path.join(opt.out, "results.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    say("RESULT", json.dumps(rec))


def graph_mem_bytes(cuda=True):
    """The driver's memory for CUDA graphs (where captured allocations go under cudaMallocAsync), in use or
    not; None off CUDA or where the runtime cannot be reached."""
    if not cuda:
        return None
    from sd_accel.engine.graphs import graph_memory
    return graph_memory.reserved_bytes()
