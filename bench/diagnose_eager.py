#!/usr/bin/env python3
"""Where an accelerated run without graphs spends the time stock does not: a diagnosis, not a benchmark (nothing
for results.jsonl; bench_patches.py records `ours_eager_its`).

SD1.5 512² b1 (`--family sdxl`: SDXL 1024² b1), 20 steps euler, one process. Four variants on one loaded model:
stock KSampler and ours with cuda_graph off on the plain model, then stock and ours (its defaults: the capture is
refused) on a clone with dev/patch_nodes.py's capture-breaking patch; `--paths` adds ours without graphs held to
each eager path. After two warm-up runs each, three alternating timed runs (median it/s), then one run of each
under cProfile: its functions by own time, and the sampler call's share spent inside the UNet step (ComfyUI's
`apply_model`) against the rest. The GPU's busy time over one run (torch.profiler's CUDA kernel total) says whether
the run is bound by the host or the GPU; the host's time in CUDA runtime calls, whether it waited there.
`--timeline` replaces the profiled runs with one run timed call by call (`timeline`).

  python3 bench/diagnose_eager.py --comfy-dir vendor/ComfyUI --out $OUT
  python3 bench/diagnose_eager.py --smoke --steps 2 --reps 1 --out /tmp/diagnose_eager   (CPU plumbing check)
  python3 bench/diagnose_eager.py --comfy-dir vendor/ComfyUI --out $OUT --patch LazyCache   (on a patched model)
"""
import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--family", choices=("sd15", "sdxl"), default="sd15")
ap.add_argument("--size", type=int, default=None, help="image side (default: 512 for sd15, 1024 for sdxl; 64 --smoke)")
ap.add_argument("--patch", default=None,
                help="a dev/patch_nodes.py case (e.g. LazyCache, EasyCache) applied to the model of every variant")
ap.add_argument("--paths", action="store_true",
                help="also: ours without graphs held to each eager path (eager.FORCED_PATH: the stock modules, then "
                     "the fused ones), to compare with the path the timing chose")
ap.add_argument("--plain-only", action="store_true",
                help="only the plain pair (stock and ours without graphs), not the pair with a refused capture: half "
                     "the time, for a slow patch at SDXL")
ap.add_argument("--timeline", action="store_true",
                help="instead of the profiles: one run of each variant with the wall time of every apply_model call "
                     "(how many reached the UNet), so that the time outside the steps and between them shows")
ap.add_argument("--kernels", action="store_true",
                help="also: the GPU time and launches of one run by kernel name, each variant against the first "
                     "(stock): whether ours runs other GPU work (layout copies, other kernels) or the same work later")
ap.add_argument("--fingerprint", action="store_true",
                help="also: per step of ours with graphs (plain and refused), whether the weights' fingerprint "
                     "came from its per-run cache, and on a miss which check failed")
OPT = ap.parse_args()
if OPT.plain_only and OPT.fingerprint:
    ap.error("--fingerprint reads the refused pair, which --plain-only leaves out")
ENV = cb.boot(OPT, ("checkpoints",))
sys.path.insert(0, os.path.join(cb.REPO, "dev"))
import patch_nodes  # noqa: E402
say = cb.say
torch = ENV.torch
SIZE = OPT.size or (64 if OPT.smoke else {"sd15": 512, "sdxl": 1024}[OPT.family])


def variants():
    model, clip, vae = cb.load_family(ENV, OPT, OPT.family, {})
    if OPT.patch:
        model = patch_nodes.apply_case(model, patch_nodes.cases(SIZE)[OPT.patch])
    broken = patch_nodes.add_capture_breaking_patch(model)
    vs = [("stock_plain", model, "stock", None), ("ours_nographs_plain", model, "ours", {"cuda_graph": False}),
          ("stock_uncapturable", broken, "stock", None), ("ours_uncapturable", broken, "ours", None)]
    if OPT.plain_only:
        vs = vs[:2]
    if OPT.paths:
        vs += [("ours_nographs_stockpath", model, "ours", {"cuda_graph": False}),
               ("ours_nographs_fusedpath", model, "ours", {"cuda_graph": False})]
    return vs, clip, vae


def forced_path(name):
    """The eager path a variant is held to (None: the one EagerPaths' timing chooses)."""
    return {"ours_nographs_stockpath": "stock", "ours_nographs_fusedpath": "fused"}.get(name)


def run(v, clip, vae, seed):
    name, model, sampler, accel = v
    from sd_accel.engine.graphs import eager
    saved, eager.FORCED_PATH = eager.FORCED_PATH, forced_path(name)
    try:
        return cb.run_graph(ENV, model, clip, vae, SIZE, 1, seed, sampler, OPT.steps, accel=accel)
    finally:
        eager.FORCED_PATH = saved


def gpu_busy_ms(v, clip, vae):
    """(GPU busy ms over one run, the host's time in the CUDA runtime's calls that can wait: the largest few,
    {kernel name: (GPU ms, launches)})."""
    if not ENV.cuda:
        return 0.0, "", {}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(v, clip, vae, 7)
    events = prof.key_averages()
    on_gpu = [e for e in events
              if e.device_type is not None and "CUDA" in str(e.device_type) and e.device_time_total]
    busy = sum(e.device_time_total for e in on_gpu) / 1000.0
    kernels = {e.key: (e.device_time_total / 1000.0, e.count) for e in on_gpu}
    runtime = sorted(((e.self_cpu_time_total / 1000.0, e.count, e.key) for e in events
                      if e.key.startswith("cuda") or e.key.startswith("cu")), reverse=True)[:6]
    return busy, ", ".join("%s %.1f ms/%d" % (k, ms, n) for ms, n, k in runtime), kernels


def kernel_difference(name, kernels, base):
    """The kernels whose GPU time or launches differ most between `kernels` and `base` (stock's), as lines."""
    rows = []
    for k in set(kernels) | set(base):
        (ms, n), (ms0, n0) = kernels.get(k, (0.0, 0)), base.get(k, (0.0, 0))
        if n != n0 or abs(ms - ms0) > 0.5:
            rows.append((abs(ms - ms0), ms - ms0, n - n0, ms, n, k))
    rows.sort(reverse=True)
    total = sum(n for _, n in kernels.values()), sum(n for _, n in base.values())
    out = ["%-22s kernels: %d launches against stock's %d; largest differences (ms, launches: ours / stock):" % (
        name, total[0], total[1])]
    for _, dms, dn, ms, n, k in rows[:15]:
        out.append("%-22s   %+8.1f ms %+6d  (%.1f ms/%d against %.1f/%d)  %s" % (
            "", dms, dn, ms, n, ms - dms, n - dn, k[:110]))
    return out


def profiled(v, clip, vae):
    pr = cProfile.Profile()
    pr.enable()
    out = run(v, clip, vae, 8)
    pr.disable()
    pr.dump_stats(os.path.join(OPT.out, "profile_%s.pstats" % v[0]))
    text = io.StringIO()
    st = pstats.Stats(pr, stream=text)
    st.sort_stats("tottime").print_stats(25)
    inside = sum(stat[3] for fn, stat in st.stats.items() if fn[2] == "apply_model" and fn[0].endswith("model_base.py"))
    return out["sample_s"], inside, text.getvalue(), out.get("line")


def timeline(v, clip, vae):
    """One run of `v` with apply_model's calls timed, as one line: its sampling time inside the calls, between
    them and around them; how many calls reached the UNet (a cache node answers the others); the garbage
    collections during the run; and the CPU time of this thread against the process's other threads (Python
    threads share the interpreter, so a busy one slows this one's host work)."""
    from comfy import model_base
    from comfy.ldm.modules.diffusionmodules import openaimodel
    calls, unet, collections = [], [0], []
    apply_model, unet_forward = model_base.BaseModel.apply_model, openaimodel.UNetModel._forward

    def timed_apply(self, *a, **k):
        t = time.perf_counter()
        try:
            return apply_model(self, *a, **k)
        finally:
            calls.append((t, time.perf_counter()))

    def counted_forward(self, *a, **k):
        unet[0] += 1
        return unet_forward(self, *a, **k)

    def collecting(phase, info):   # a full collection pauses the host for the whole heap
        if phase == "start":
            collections.append([info["generation"], time.perf_counter()])
        else:
            collections[-1][1] = time.perf_counter() - collections[-1][1]
    model_base.BaseModel.apply_model, openaimodel.UNetModel._forward = timed_apply, counted_forward
    gc.callbacks.append(collecting)
    cpu0, main0 = time.process_time(), time.thread_time()
    try:
        out = run(v, clip, vae, 11)
        cpu, main = time.process_time() - cpu0, time.thread_time() - main0
    finally:
        gc.callbacks.remove(collecting)
        model_base.BaseModel.apply_model, openaimodel.UNetModel._forward = apply_model, unet_forward
    by_gen = {g: [1000 * t for gen, t in collections if gen == g] for g in (0, 1, 2)}
    inside = sum(b - a for a, b in calls)
    gaps = [calls[i + 1][0] - calls[i][1] for i in range(len(calls) - 1)]
    return ("CPU s: this thread %.2f, others %.2f (%d threads); sampling %.3f s: %d apply_model calls (%d reached "
            "the UNet) %.3f s, between them %.3f s (largest %.1f ms), before the first and after the last %.3f s; "
            "garbage collections (generation: count, ms): %s; apply_model ms: %s" % (
                main, cpu - main, threading.active_count(), out["sample_s"], len(calls), unet[0], inside, sum(gaps),
                1000 * max(gaps or [0]), out["sample_s"] - inside - sum(gaps),
                ", ".join("%d: %d, %.1f" % (g, len(ts), sum(ts)) for g, ts in by_gen.items()),
                " ".join("%.0f" % (1000 * (b - a)) for a, b in calls)))


def fingerprint_misses(v, clip, vae):
    """{outcome: calls} of WeightsFingerprint.read over one run of `v` (outcome "cached", or the failed check)."""
    from sd_accel.engine.graphs import fingerprint as fpm
    original, seen = fpm.WeightsFingerprint.read, {}

    def read(self, epoch=None):
        last, same_epoch = self._last, epoch is not None and epoch is self.epoch
        out = original(self, epoch)
        if not same_epoch or last is None:
            why = "new epoch" if not same_epoch else "no read cached yet"
        elif out is last.result:
            why = "cached"
        else:
            tensors = self.tensors()
            if last.dead:
                why = "a tensor of the last read was freed"
            elif [id(t) for t in tensors] != last.ids:
                why = "tensor objects changed"
            elif not all(tensors[i]._version == ver for i, ver in last.versioned):
                moved = [self.names[i] for i, ver in last.versioned if tensors[i]._version != ver]
                why = "versions moved: %s" % ",".join(sorted(set(moved))[:6])
            else:
                why = "residency token changed"
        seen[why] = seen.get(why, 0) + 1
        return out
    fpm.WeightsFingerprint.read = read
    try:
        run(v, clip, vae, 9)
    finally:
        fpm.WeightsFingerprint.read = original
    return seen


def main():
    vs, clip, vae = variants()
    for v in vs:
        for seed in (1, 2):
            run(v, clip, vae, seed)
    times = {v[0]: [] for v in vs}
    for rep in range(OPT.reps):
        for v in vs:
            times[v[0]].append(run(v, clip, vae, 100 + rep)["sample_s"])
    lines, kernels_of = [], {}
    for v in vs:
        med = statistics.median(times[v[0]])
        say("%-22s %7.2f it/s, sampling %.3f s (median of %d)" % (v[0], OPT.steps / med, med, OPT.reps))
        if OPT.timeline:
            lines.append("%-22s %7.2f it/s  %s" % (v[0], OPT.steps / med, timeline(v, clip, vae)))
            continue
        busy, runtime, kernels_of[v[0]] = gpu_busy_ms(v, clip, vae)
        say("%-22s GPU busy %.1f ms; host in CUDA calls: %s" % (v[0], busy, runtime))   # kept if the profile times out
        if OPT.kernels and v is not vs[0]:
            diff = kernel_difference(v[0], kernels_of[v[0]], kernels_of[vs[0][0]])
            say("\n".join(diff))
            lines.extend(diff)
        sample_s, inside, text, line = profiled(v, clip, vae)
        lines.append("%-22s %7.2f it/s  sampling %.3f s  GPU busy %.1f ms  under cProfile %.3f s, apply_model "
                     "cumulative %.3f s" % (v[0], OPT.steps / med, med, busy, sample_s, inside))
        lines.append("%-22s host in CUDA calls: %s" % ("", runtime))
        if line:
            lines.append("%-22s report: %s" % ("", line[:600]))
        with open(os.path.join(OPT.out, "profile_%s.txt" % v[0]), "w") as f:
            f.write(text)
        say("PROFILE", v[0], "\n" + "\n".join(text.splitlines()[:40]))
    if OPT.fingerprint:
        plain = ("ours_plain", vs[0][1], "ours", None)
        for v in (plain, vs[3]):
            run(v, clip, vae, 1)
            lines.append("%-22s fingerprint reads: %s" % (v[0], fingerprint_misses(v, clip, vae)))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
