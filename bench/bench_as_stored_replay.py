#!/usr/bin/env python3
"""fp8_weights "as stored" on the GPU alone: a UNet call's time with its fp8-stored layers cast a group at a time
(engine/fp8/block_upcast.py), against the kept fp16 copies and ComfyUI's own per-layer cast, from CUDA-graph
replays timed by CUDA events, so the host's speed does not enter (the sampler's it/s, where it does:
bench_fp8_stored.py).

The random SD1.5 checkpoint's UNet (`--families sd15,sdxl`: SDXL's too) loaded as UNETLoader fp8_e4m3fn loads it,
its diffusion model called as ComfyUI's apply_model calls it (one CFG step: batch 2, 512² / 1024²), with only the
fp8-stored layers' forward patches applied (engine/fp8/upcast.py; ComfyUI's modules otherwise): what the casts
cost, not SD Accel's whole step. Each variant is captured once; then --reps rounds, each replaying every variant
--replays times in turn; the median of the rounds' ms per replay. `--group-mib`: the groups' size
(block_upcast.GROUP_BYTES), one "as stored" variant per value. Each variant's output is compared with stock's.

  python3 bench/bench_as_stored_replay.py --comfy-dir vendor/ComfyUI --out $OUT [--families sd15,sdxl]
"""
import argparse
import contextlib
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap, deadline=300.0)
ap.add_argument("--families", default="sd15")
ap.add_argument("--replays", type=int, default=20)
ap.add_argument("--group-mib", default="64", help="comma-separated group sizes in MiB of fp16 weights")
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
import folder_paths  # noqa: E402
import patch_nodes  # noqa: E402
folder_paths.add_model_folder_path("diffusion_models", os.path.join(OPT.work, "checkpoints"))
torch = ENV.torch
from sd_accel.engine.fp8 import block_upcast  # noqa: E402
from sd_accel.engine.fp8 import weights as fp8_weights  # noqa: E402
from sd_accel.engine.fp8.upcast import plan_upcast  # noqa: E402
from sd_accel.engine.patches import patching  # noqa: E402

SIZE = {"sd15": 512, "sdxl": 1024}


@contextlib.contextmanager
def group_bytes(n):
    real = block_upcast.GROUP_BYTES
    block_upcast.GROUP_BYTES = n
    try:
        yield
    finally:
        block_upcast.GROUP_BYTES = real


def inputs(model, dm, size):
    dtype = model.model.manual_cast_dtype or torch.float16
    attn2 = next(m for m in dm.modules()
                 if type(m).__name__ == "CrossAttention" and m.to_k.in_features != m.to_q.in_features)
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = {"context": torch.randn(2, 77, attn2.to_k.in_features, device="cuda", dtype=dtype, generator=g)}
    if getattr(dm, "label_emb", None) is not None:
        kw["y"] = torch.randn(2, dm.label_emb[0][0].in_features, device="cuda", dtype=dtype, generator=g)
    x = torch.randn(2, 4, size // 8, size // 8, device="cuda", dtype=dtype, generator=g)
    return x, torch.tensor([500.0, 500.0], device="cuda"), kw


def capture(dm, plan, x, t, kw):
    """(graph, its output) of one call of `dm` with `plan`'s forward patches, captured after two eager calls."""
    def call():
        with fp8_weights.host_state(None), block_upcast.step():
            return dm(x, t, **kw)
    backup = patching.apply_patches(dm, plan) if plan else None
    try:
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
            graph.replay()
            torch.cuda.synchronize()
    finally:
        if backup:
            patching.restore(dm, backup)
    return graph, out


def ms_per_replay(graph, n):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def measure(family, vers):
    name = "random_%s_fp16.safetensors" % family
    path = os.path.join(OPT.work, "checkpoints", name)
    ENV.fixtures.ensure(path, ENV.fixtures.build_checkpoint, OPT.comfy_dir, family, "sd15", path, 1234)
    model = patch_nodes.load_fp8_unet(name)
    with torch.inference_mode():     # as ComfyUI's executor loads it (the weights are inference tensors)
        ENV.mm.load_models_gpu([model])
    dm = model.model.diffusion_model
    x, t, kw = inputs(model, dm, SIZE[family])
    sizes = [int(v) for v in OPT.group_mib.split(",")]
    variants = {"stock": None, "copies": plan_upcast(dm)[0]}
    for mib in sizes:
        with group_bytes(mib << 20):     # the groups are formed at planning
            variants["as_stored_%dmib" % mib] = plan_upcast(dm, grouped=True)[0]
    graphs = {v: capture(dm, plan, x, t, kw) for v, plan in variants.items()}
    rounds = {v: [] for v in variants}
    for _ in range(OPT.reps):
        for v, (graph, _) in graphs.items():
            rounds[v].append(ms_per_replay(graph, OPT.replays))
    ms = {v: statistics.median(r) for v, r in rounds.items()}
    ref = graphs["stock"][1].float()
    diff = {v: float((out.float() - ref).abs().max()) for v, (_, out) in graphs.items()}
    for v in variants:
        cb.say("%-6s %-26s %7.3f ms per call (rounds: %s), max |diff| vs stock %.3g" % (
            family, v, ms[v], ", ".join("%.3f" % r for r in rounds[v]), diff[v]))
    config = "as_stored_replay_%s_%d_b2" % (family, SIZE[family])
    return dict(vers, date=datetime.date.today().isoformat(), config=config,
                replays=OPT.replays, rounds=OPT.reps, ms={v: round(m, 3) for v, m in ms.items()},
                max_abs_diff_vs_stock={v: round(d, 5) for v, d in diff.items()},
                notes="UNETLoader fp8_e4m3fn UNet, one diffusion-model call (batch 2) as a CUDA graph per variant, "
                      "only the fp8 layers' forward patches (ComfyUI's modules otherwise); CUDA-event ms per replay")


def main():
    vers = cb.versions(ENV, OPT.comfy_dir)
    for family in OPT.families.split(","):
        cb.append_record(OPT, measure(family, vers))
        ENV.mm.unload_all_models()
        ENV.mm.soft_empty_cache()


if __name__ == "__main__":
    main()
