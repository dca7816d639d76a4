"""First-run overhead on a cold Triton cache (a user's first generation after installing, or after a Triton or
driver upgrade), with the step's kernels compiled one by one as they are reached and compiled in parallel ahead
of their first launch (kernels/_compile_ahead.run_compiling_ahead, the default).

Each variant is one `bench_unet.py` process (stock and SD Accel side by side, as always) with its own empty
TRITON_CACHE_DIR, so both start equally cold; the first accelerated run minus a warm one is `first_run_s`.
Config names get `_coldcache`; `parallel_compile` says which variant. Prints a table last.

    python bench/bench_first_run.py --comfy-dir vendor/ComfyUI --out /tmp/first
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

ap = argparse.ArgumentParser()
ap.add_argument("--comfy-dir", default=os.path.join(HERE, "..", "vendor", "ComfyUI"))
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
ap.add_argument("--work", default="/tmp/sdaccel_bench")
ap.add_argument("--configs", default="sd15_768_b1")
ap.add_argument("--variants", default="sequential,parallel")
ap.add_argument("--timeout", type=float, default=240.0, help="seconds per bench_unet process")
opt = ap.parse_args()

rows = []
os.makedirs(opt.out, exist_ok=True)
for variant in opt.variants.split(","):
    sub_out = os.path.join(opt.out, variant)
    os.makedirs(sub_out, exist_ok=True)
    # the defaults (cuDNN autotuning off, engine/graphs/eager.CUDNN_AUTOTUNE) unless the variant names it:
    # "parallel-autotune" turns it on ("parallel-noautotune", session 7's name, is the default "parallel")
    autotune = variant.endswith("-autotune")
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton_cold_"),
               SDACCEL_PARALLEL_COMPILE="0" if variant == "sequential" else "1",
               SDACCEL_CUDNN_AUTOTUNE="1" if autotune else "0")
    cmd = [sys.executable, os.path.join(HERE, "bench_unet.py"), "--comfy-dir", opt.comfy_dir, "--work", opt.work,
           "--out", sub_out, "--configs", opt.configs, "--compile", "", "--reps", "1"]
    t0 = time.time()
    with open(os.path.join(sub_out, "log.txt"), "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=opt.timeout).returncode
    print("[first-run] %s: exit %d in %.0f s" % (variant, rc, time.time() - t0), flush=True)
    path = os.path.join(sub_out, "results.jsonl")
    if not os.path.exists(path):
        continue
    for line in open(path):
        rec = json.loads(line)
        rec["config"] += "_coldcache"
        rec["parallel_compile"] = variant != "sequential"
        rec["cudnn_autotune"] = autotune
        rec["notes"] = "cold Triton cache (empty TRITON_CACHE_DIR), kernels compiled %s; %s" % (
            "in parallel ahead of their first launch" if variant != "sequential" else "one by one as reached",
            rec.get("notes", ""))
        rows.append(rec)
        with open(os.path.join(opt.out, "results.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")

print("%-22s %-20s %8s %9s %9s %8s %8s %9s %7s" % ("config", "compile", "first s", "launches", "launch s",
                                                  "ahead", "ahead s", "ours it/s", "PSNR"))
for r in rows:
    print("%-22s %-20s %8.2f %9d %9.2f %8d %8.2f %9.2f %7.1f" % (
        r["config"], ("parallel" if r["parallel_compile"] else "sequential")
        + (", cuDNN autotune" if r["cudnn_autotune"] else ""), r["first_run_s"],
        r.get("triton_first_launches", 0), r.get("triton_first_launch_s", 0.0), r.get("triton_compiled_ahead", 0),
        r.get("triton_compiled_ahead_s", 0.0), r["ours_its"], r["psnr_db"]))
