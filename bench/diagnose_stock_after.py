#!/usr/bin/env python3
"""Why stock KSampler runs slower on a loaded model after the Accelerated KSampler ran on it: a diagnosis, not a
benchmark (nothing for results.jsonl; bench_stock_after.py records the effect).

One family (default SDXL 1024² b1, where the effect shows: SD1.5 512² is host-bound), one process. Stock
KSampler's it/s, the GPU's SM clock, power and temperature during the run (nvidia-smi sampled every 0.2 s),
cuDNN's benchmark flag and the conv weights' layouts, at each phase:
  before          stock, before any run of ours
  after           right after one Accelerated KSampler run with graphs
  after_pause     after 30 s idle (a GPU that throttled under the graphs' load recovers)
  graphs_freed    after the model's graphs and their pool are dropped
  reloaded        after ComfyUI unloads and reloads the model
and the CUDA kernels by GPU time for one stock run before and after, side by side (which got slower).

  python3 bench/diagnose_stock_after.py --comfy-dir vendor/ComfyUI --out $OUT [--family sd15]
"""
import argparse
import collections
import gc
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap)
ap.add_argument("--family", default="sdxl")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--pause", type=float, default=30.0)
OPT = ap.parse_args()
ENV = cb.boot(OPT)
torch = ENV.torch
SIZE = 64 if OPT.smoke else {"sd15": 512, "sdxl": 1024}[OPT.family]
LINES = []


def out(*a):
    s = " ".join(str(x) for x in a)
    LINES.append(s)
    print(s, flush=True)


class GpuSampler(threading.Thread):
    """nvidia-smi's SM clock (MHz), power (W), temperature (C) and clock-event reasons, every 0.2 s."""
    QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self):
        super().__init__(daemon=True)
        self.rows, self.stop = [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                line = subprocess.run(["nvidia-smi", "--query-gpu=" + self.QUERY, "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=5).stdout.strip().splitlines()[0]
                self.rows.append([v.strip() for v in line.split(",")])
            except (OSError, IndexError, subprocess.TimeoutExpired):
                return
            time.sleep(0.2)

    def summary(self):
        if not self.rows:
            return "no nvidia-smi"
        num = lambda i: statistics.median(float(r[i]) for r in self.rows if r[i].replace(".", "").isdigit())  # noqa
        reasons = collections.Counter(r[3] for r in self.rows)
        return "sm %.0f MHz, %.0f W, %.0f C, reasons %s" % (num(0), num(1), num(2), dict(reasons))


def stock_its(model, clip, vae):
    run = lambda seed: cb.run_graph(ENV, model, clip, vae, SIZE, 1, seed, "stock", OPT.steps)  # noqa: E731
    run(1)
    sampler = GpuSampler()
    sampler.start()
    times = [run(100 + i)["sample_s"] for i in range(OPT.reps)]
    sampler.stop.set()
    sampler.join()
    return OPT.steps / statistics.median(times), sampler.summary()


def layouts(model):
    convs = [m.weight for m in model.model.diffusion_model.modules()
             if isinstance(m, torch.nn.Conv2d) and m.weight is not None]
    cl = sum(1 for w in convs if w.dim() == 4 and not w.is_contiguous()
             and w.is_contiguous(memory_format=torch.channels_last))
    return "%d conv weights, %d channels_last, %d on the GPU" % (len(convs), cl, sum(1 for w in convs if w.is_cuda))


def kernels(model, clip, vae):
    """GPU time (ms) per kernel name over one stock run."""
    return cb.cuda_kernel_times(ENV, lambda: cb.run_graph(ENV, model, clip, vae, SIZE, 1, 7, "stock", OPT.steps))[0]


def loaded():
    """What ComfyUI holds loaded (GiB on the GPU of each model's size) and what it counts as free."""
    parts = []
    for lm in ENV.mm.current_loaded_models:
        try:
            parts.append("%s %.2f/%.2f" % (type(lm.model.model).__name__, lm.model.loaded_size() / 2 ** 30,
                                           lm.model.model_size() / 2 ** 30))
        except AttributeError:   # a patcher without loaded_size (ComfyUI 2024)
            parts.append(type(lm.model.model).__name__)
    free = ENV.mm.get_free_memory() / 2 ** 30 if ENV.cuda else 0.0
    return "loaded %s; free %.1f GiB" % (", ".join(parts), free)


def phase(name, model, clip, vae):
    its, gpu = stock_its(model, clip, vae)
    out("%-13s stock %.2f it/s | %s | cudnn.benchmark %s | %s | %s" % (
        name, its, gpu, torch.backends.cudnn.benchmark, layouts(model), loaded()))


def main():
    model, clip, vae = cb.load_family(ENV, OPT, OPT.family, {})
    phase("before", model, clip, vae)
    k_before = kernels(model, clip, vae)
    r = cb.run_graph(ENV, model, clip, vae, SIZE, 1, 5, "ours", OPT.steps)
    out("ours          %.2f it/s | %s" % (OPT.steps / r["sample_s"], r["line"][:200]))
    phase("after", model, clip, vae)
    k_after = kernels(model, clip, vae)
    time.sleep(0 if OPT.smoke else OPT.pause)
    phase("after_pause", model, clip, vae)
    from sd_accel.hosts.comfyui import accelerate
    st = getattr(model.model, accelerate._STATE_ATTR, None)
    if st is not None and st.graphs is not None:
        st.graphs.clear("diagnosis")
    gc.collect()
    if ENV.cuda:
        torch.cuda.empty_cache()
    phase("graphs_freed", model, clip, vae)
    ENV.mm.unload_all_models()
    ENV.mm.soft_empty_cache()
    phase("reloaded", model, clip, vae)
    out("kernels by GPU ms over one stock run: before | after | name")
    for name, _ in (k_before + k_after).most_common(25):
        out("%9.2f %9.2f  %s" % (k_before.get(name, 0.0), k_after.get(name, 0.0), name))
    out("total     %9.2f %9.2f" % (sum(k_before.values()), sum(k_after.values())))
    with open(os.path.join(OPT.out, "diagnose_stock_after_%s.txt" % OPT.family), "w") as f:
        f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
