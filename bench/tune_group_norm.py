"""Sweeps group_norm_silu's tiling constants over the GroupNorm calls of a real SD1.5 UNet forward (GPU only).

    python bench/tune_group_norm.py [--out DIR]

The call mix is one SD1.5 forward at CFG batch 2, channels_last fp16, as the patched UNet makes them (shape,
SiLU or not, a timestep-embedding add or not, and how many times per forward: counted on CPU by running
ComfyUI's UNetModel with the SD Accel patches). Every configuration's kernels are compiled in parallel first
(kernels/_compile_ahead.run_compiling_ahead); each call is then timed as 20 calls replayed from one CUDA graph (GPU
time, what a graphed step pays). Prints, per resolution, the weighted µs per forward of the current
constants and of the best configurations, and each shape's best; the constants in
kernels/_group_norm_tiling.py come from here.
"""
import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_timing  # noqa: E402,F401  (registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels import _compile_ahead, _device, _launch  # noqa: E402
from sd_accel.kernels import _group_norm_tiling as tiling  # noqa: E402
from sd_accel.kernels import group_norm_silu as gn  # noqa: E402

# (C, H, activation, has add): count per SD1.5 forward (CFG batch 2), at 512² (H = latent side) and 768²
MIX = {
    512: {(1280, 16, "silu", 0): 1, (1280, 16, "silu", 1): 5, (1280, 16, None, 0): 5, (1280, 32, "silu", 0): 1,
          (1280, 8, "silu", 0): 4, (1280, 8, "silu", 1): 7, (1280, 8, None, 0): 1, (1920, 16, "silu", 0): 1,
          (1920, 32, "silu", 0): 1, (2560, 16, "silu", 0): 2, (2560, 8, "silu", 0): 3, (320, 32, "silu", 0): 1,
          (320, 64, "silu", 0): 3, (320, 64, "silu", 1): 5, (320, 64, None, 0): 5, (640, 16, "silu", 0): 1,
          (640, 32, "silu", 0): 1, (640, 32, "silu", 1): 5, (640, 32, None, 0): 5, (640, 64, "silu", 0): 2,
          (960, 32, "silu", 0): 1, (960, 64, "silu", 0): 1},
}
MIX[768] = {(c, h * 3 // 2, a, d): n for (c, h, a, d), n in MIX[512].items()}

KNOBS = ("ONE_TILE_MAX", "TILE", "CL_TARGET_C", "MAX_CHUNKS", "MERGE_MAX", "WARPS")   # of _group_norm_tiling
# CL_TARGET_C None: the row width the op picks per channel count (cl_target_c)
GRID = {"ONE_TILE_MAX": (16384, 8192, 4096), "TILE": (2048, 4096), "CL_TARGET_C": (None, 32, 64, 128),
        "MAX_CHUNKS": (64,), "MERGE_MAX": (512,), "WARPS": (None,)}


def timed_us(fn, calls=20, reps=15):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tune_gn"))
    opt = ap.parse_args()
    os.makedirs(opt.out, exist_ok=True)
    default = {k: getattr(tiling, k) for k in KNOBS}
    configs = [dict(zip(KNOBS, v)) for v in itertools.product(*(GRID[k] for k in KNOBS))]
    configs = [default] + [c for c in configs if c != default]
    torch.manual_seed(0)
    inputs = {}
    for res, mix in MIX.items():
        for (C, H, act, add) in mix:
            x = (torch.randn(2, C, H, H, device="cuda", dtype=torch.float16) * 2 + 0.5).to(
                memory_format=torch.channels_last)
            w, b = torch.randn(C, device="cuda", dtype=torch.float16), torch.randn(C, device="cuda", dtype=torch.float16)
            e = torch.randn(2, C, device="cuda") if add else None
            inputs[(C, H, act, add)] = (x, w, b, e, act)

    def call(key):
        x, w, b, e, act = inputs[key]
        return gn.group_norm_silu(x, 32, w, b, activation=act, add=e)

    def setc(c):
        for k, v in c.items():
            setattr(tiling, k, v)

    # one plan per (config, shape) is what runs; configs that plan a shape identically share its timing
    sms = _device.sm_count(torch.device("cuda"))
    def plan_key(c, key):
        C, H = key[0], key[1]
        setc(c)
        if tiling.one_program_per_group(C, H * H, 32):
            return ("1prog", key)
        return ("split", key, tiling.split_config(2, C, H * H, 32, True, sms), tiling.WARPS)

    plans = {}
    for c in configs:
        for key in inputs:
            plans.setdefault(plan_key(c, key), (c, key))

    def compile_all():
        for c, key in plans.values():
            setc(c)
            call(key)
    _, n = _compile_ahead.run_compiling_ahead(compile_all)
    print("[tune] %d distinct plans, %d kernels compiled ahead in %.1f s" % (
        len(plans), n, _launch.first_launches["ahead_seconds"]), flush=True)
    us = {}
    for pk, (c, key) in plans.items():
        setc(c)
        out = call(key)
        assert gn.group_norm_silu.last_call.path == "triton", gn.group_norm_silu.last_call.reason
        x, w, b, e, act = inputs[key]
        ref = gn.group_norm_silu_reference(x.float(), 32, w.float(), b.float(), activation=act, add=e)
        err = (out.float() - ref).abs().max().item()
        assert err < 5e-2, (pk, err)
        us[pk] = timed_us(lambda: call(key))
    setc(default)
    results = []
    for res, mix in MIX.items():
        rows = []
        for c in configs:
            total = sum(n * us[plan_key(c, key)] for key, n in mix.items())
            rows.append((total, c))
        setc(default)
        rows.sort(key=lambda r: r[0])
        base = next(t for t, c in rows if c == default)
        print("\n== SD1.5 %d² (CFG batch 2), %d GroupNorm calls per forward: current constants %.1f µs" % (
            res, sum(mix.values()), base))
        for t, c in rows[:8]:
            print("  %7.1f µs  %s" % (t, json.dumps(c)))
        print("  per shape (count, current µs, best µs, best plan):")
        for key, n in sorted(mix.items(), key=lambda kv: -kv[1] * us[plan_key(default, kv[0])]):
            cur = us[plan_key(default, key)]
            best_c = min(configs, key=lambda c: us[plan_key(c, key)])
            bk = plan_key(best_c, key)
            print("    %-24s x%d  %6.1f  %6.1f  %s" % (key, n, cur, us[bk], bk[0] if bk[0] == "1prog" else
                                                      json.dumps(best_c)))
        setc(default)
        results.append({"res": res, "current_us": base, "best": [(t, c) for t, c in rows[:8]]})
    print("\n== every configuration, µs per forward at 512² + 768²")
    both = sorted(configs, key=lambda c: sum(n * us[plan_key(c, k)] for m in MIX.values() for k, n in m.items()))
    for c in both:
        t = [sum(n * us[plan_key(c, k)] for k, n in m.items()) for m in MIX.values()]
        print("  %7.1f %7.1f  %s%s" % (t[0], t[1], json.dumps(c), "  (current)" if c == default else ""))
    setc(default)
    with open(os.path.join(opt.out, "tune_group_norm.json"), "w") as f:
        json.dump({"results": results}, f, indent=1)


if __name__ == "__main__":
    main()
