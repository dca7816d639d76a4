#!/usr/bin/env python3
"""Where the time of one Accelerated KSampler run goes, on the GPU machine: a diagnosis, not a benchmark.

For each config (SD1.5 512² b1 fully resident; SDXL 1024² at a 4 GiB VRAM Pool lowvram budget), after two
warm runs:
  1. host-clock timeline of one run, no profiler: the node call's start, each UNet step (our graph runner's
     entry and exit), its end; CUDA events around every replay give each replay's GPU time and the GPU gap
     between replays (what the sampler's own ops and any idle time cost);
  2. the same graph replayed back to back on its own (its GPU time without the sampler);
  3. one run under torch.profiler (CPU + CUDA): the GPU's busy time over the run, its idle gaps and which
     CPU ops ran during the longest ones, the CPU ops by self time, and for streamed runs the copy
     stream's busy time, its overlap with compute and its rate. The trace goes to $OUT/trace_<config>.json.gz.
Nothing is recorded in results.jsonl (no stock side); the summary goes to the log and $OUT/profile_<config>.txt.

  python3 bench/profile_step.py --comfy-dir vendor/ComfyUI --out $OUT [--configs sd15_512_b1,sdxl_1024_b1_budget4]
"""
import argparse
import gzip
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

CONFIGS = {"sd15_512_b1": ("sd15", 512, 1, None), "sdxl_1024_b1": ("sdxl", 1024, 1, None),
           "sdxl_1024_b1_budget4": ("sdxl", 1024, 1, 4.0), "sd15_512_b1_budget1": ("sd15", 512, 1, 1.0)}
ap = argparse.ArgumentParser()
cb.add_common_args(ap)
ap.add_argument("--configs", default="sd15_512_b1,sdxl_1024_b1_budget4")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--outside", action="store_true", help="also stock vs ours outside the steps, with cProfile")
ap.add_argument("--stacks", action="store_true", help="also the Python stacks of CPU ops of 1 ms or more")
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
torch, mm = ENV.torch, ENV.mm
say = cb.say
from sd_accel.engine.memory import host_mirror  # noqa: E402
from sd_accel.engine.graphs import step_graphs  # noqa: E402

LOADED = {}
LINES = []


def out(*a):
    s = " ".join(str(x) for x in a)
    LINES.append(s)
    print(s, flush=True)


class StepClock:
    """Wraps StepGraphs.run: host time at entry/exit and CUDA events around each call."""

    def __init__(self):
        self.calls = []
        self.orig = step_graphs.StepGraphs.run

    def __enter__(self):
        clock = self

        def run(graphs, *a, **k):
            t0 = time.perf_counter()
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            r = clock.orig(graphs, *a, **k)
            e1.record()
            clock.calls.append((t0, time.perf_counter(), e0, e1, graphs.name))
            return r
        step_graphs.StepGraphs.run = run
        return self

    def __exit__(self, *exc):
        step_graphs.StepGraphs.run = self.orig


class HostEvents:
    """Host-clock spans of the calls that make a prompt's set-up cost (ComfyUI's loader, partial loads and
    unloads, our graph captures and drops), to tell apart what the time before the first step goes to."""

    def __init__(self, targets=None):
        import comfy.model_patcher as mp
        self.targets = targets or [
            (mm, "load_models_gpu"), (mm, "free_memory"), (mp.ModelPatcher, "partially_load"),
            (mp.ModelPatcher, "partially_unload"), (mp.ModelPatcher, "detach"), (mp.ModelPatcher, "load"),
            (step_graphs.StepGraphs, "_capture"), (step_graphs.StepGraphs, "clear"), (torch.cuda, "empty_cache"),
            (torch.cuda.CUDAGraph, "capture_begin"), (torch.cuda.CUDAGraph, "capture_end"),
            (host_mirror.HostMirror, "offload")]
        self.events, self.saved = [], []

    def __enter__(self):
        for obj, name in self.targets:
            orig = getattr(obj, name, None)
            if orig is None:
                continue
            self.saved.append((obj, name, orig))
            setattr(obj, name, self._timed(orig, "%s.%s" % (getattr(obj, "__name__", "?"), name)))
        return self

    def _timed(self, orig, label):
        events = self.events

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                events.append((t0, time.perf_counter(), label))
        return timed

    def __exit__(self, *exc):
        for obj, name, orig in reversed(self.saved):
            setattr(obj, name, orig)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def host_timeline(run):
    with StepClock() as clock, HostEvents() as host:
        t0 = time.perf_counter()
        res = run(7)
        t1 = time.perf_counter()
    torch.cuda.synchronize()
    for a, b, label in sorted(host.events)[:60]:
        out("  host event +%.1f ms: %s %.1f ms" % ((a - t0) * 1e3, label, (b - a) * 1e3))
    calls = clock.calls
    if not calls:
        out("  no graph runner call seen")
        return
    cpu = [(b - a) * 1e3 for a, b, *_ in calls]
    gaps_cpu = [(calls[i + 1][0] - calls[i][1]) * 1e3 for i in range(len(calls) - 1)]
    gpu = [e0.elapsed_time(e1) for _, _, e0, e1, _ in calls]
    gpu_gap = [calls[i][3].elapsed_time(calls[i + 1][2]) for i in range(len(calls) - 1)]
    out("  sampling call (run_graph's sample_s, host clock) %.1f ms for %d runner calls"
        % (res["sample_s"] * 1e3, len(calls)))
    out("  graph() wall %.1f ms; sample_s %.1f ms; before first step (host) %.1f ms; after last step exit %.1f ms"
        % ((t1 - t0) * 1e3, res["sample_s"] * 1e3, (calls[0][0] - t0) * 1e3, (t1 - calls[-1][1]) * 1e3))
    out("  per runner call: host inside %.3f ms (median; min %.3f max %.3f); host between calls %.3f ms (median)"
        % (med(cpu), min(cpu), max(cpu), med(gaps_cpu)))
    out("  per runner call: GPU %.3f ms (median; min %.3f max %.3f); GPU between calls %.3f ms (median; max %.3f)"
        % (med(gpu), min(gpu), max(gpu), med(gpu_gap), max(gpu_gap) if gpu_gap else 0))
    out("  GPU first event -> last event %.1f ms" % calls[0][2].elapsed_time(calls[-1][3]))
    out("  first 6 calls: host inside %s ms; host between %s ms; GPU between %s ms" % (
        ", ".join("%.2f" % v for v in cpu[:6]), ", ".join("%.2f" % v for v in gaps_cpu[:6]),
        ", ".join("%.2f" % v for v in gpu_gap[:6])))


def apply_clock():
    """HostEvents around each BaseModel.apply_model and comfy.sample.sample (what KSampler and Accelerated
    KSampler both call): the time before the first step and after the last, stock and ours alike."""
    import comfy.model_base as mb
    import comfy.sample as cs
    return HostEvents([(mb.BaseModel, "apply_model"), (cs, "sample")])


def outside_steps(model, clip, vae, size, batch):
    """Stock KSampler and ours, warm, same process: host ms from comfy.sample.sample's entry to the first
    apply_model, from the last one's return to its exit (the latent back on the CPU: waits for the GPU), and
    the node's own time around it; then one run of each under cProfile: the functions with the most
    cumulative time (the steps' share is the apply_model line), i.e. what a prompt pays besides the steps."""
    import cProfile
    import pstats
    for sampler in ("stock", "ours"):
        for s in (1, 2):
            cb.run_graph(ENV, model, clip, vae, size, batch, s, sampler, OPT.steps)
        rows = []
        for s in (3, 4, 5):
            with apply_clock() as clock:
                res = cb.run_graph(ENV, model, clip, vae, size, batch, s, sampler, OPT.steps)
            steps = [e for e in clock.events if e[2].endswith(".apply_model")]
            (s0, s1, _), = [e for e in clock.events if e[2].endswith(".sample")]
            rows.append((res["sample_s"] * 1e3, (steps[0][0] - s0) * 1e3, (s1 - steps[-1][1]) * 1e3,
                         res["sample_s"] * 1e3 - (s1 - s0) * 1e3, len(steps)))
        out("  %s (%d steps), ms per run: sampling node %s | comfy.sample.sample entry -> first step %s | last "
            "step -> its exit %s | node outside comfy.sample.sample %s" % (
                sampler, rows[-1][4], *[", ".join("%.1f" % r[i] for r in rows) for i in range(4)]))
        pr = cProfile.Profile()
        pr.enable()
        cb.run_graph(ENV, model, clip, vae, size, batch, 6, sampler, OPT.steps)
        pr.disable()
        keep = []
        for (fname, line, func), (cc, nc, tt, ct, callers) in pstats.Stats(pr).stats.items():
            keep.append((ct, tt, nc, "%s:%d(%s)" % (fname.split("/")[-1], line, func)))
        keep.sort(reverse=True)
        out("  %s under cProfile (one run incl. text encode and decode): cumulative ms, own ms, calls:" % sampler)
        for ct, tt, nc, name in keep[:80]:
            out("    %8.2f %7.2f %6d  %s" % (ct * 1e3, tt * 1e3, nc, name))


def replay_alone(graphs_list):
    for g in graphs_list:
        for key, entry in list(g.entries.items()):
            for _ in range(3):
                entry.graph.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 30
            e0.record()
            for _ in range(n):
                entry.graph.replay()
            e1.record()
            torch.cuda.synchronize()
            out("  graph %s (%d tensors in): %.3f ms per replay, back to back" % (
                g.name, len(entry.static_in), e0.elapsed_time(e1) / n))


def _intervals_union(iv):
    iv = sorted(iv)
    merged = []
    for a, b in iv:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _total(m):
    return sum(b - a for a, b in m)


def _intersect(m1, m2):
    i = j = 0
    tot = 0.0
    while i < len(m1) and j < len(m2):
        a, b = max(m1[i][0], m2[j][0]), min(m1[i][1], m2[j][1])
        if a < b:
            tot += b - a
        if m1[i][1] < m2[j][1]:
            i += 1
        else:
            j += 1
    return tot


def long_ops_with_stacks(run, min_ms=1.0):
    """One warm run under the profiler with Python stacks: every CPU op that took `min_ms` or more, with the
    innermost project/ComfyUI frames that called it (a long CPU op in a step keeps the GPU waiting)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True) as prof:
        run(9)
    rows = []
    for e in prof.events():
        ms = e.cpu_time_total / 1e3 if hasattr(e, "cpu_time_total") else 0.0
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if ms >= min_ms and e.name.startswith("aten::") and parent is None:   # not inside another aten op
            frames, p = list(e.stack or []), e.cpu_parent
            while p is not None:     # the Python function events above it (with_stack records them)
                frames.append(p.name)
                p = p.cpu_parent
            frames = [f for f in frames if "torch/" not in f and "profile_step" not in f and "<built-in" not in f]
            rows.append((e.time_range.start, ms, e.name, getattr(e, "input_shapes", None), frames[:10]))
    out("  top-level aten ops of %.1f ms or more in one warm run (start order):" % min_ms)
    for _, ms, name, shapes, frames in sorted(rows)[:20]:
        out("    %6.2f ms %s shapes %s" % (ms, name, str(shapes)[:160]))
        for f in frames:
            out("        " + f[:160])


def profiled(run, tag):
    from torch.profiler import ProfilerActivity, profile
    if OPT.stacks:
        long_ops_with_stacks(run)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(8)
    path = os.path.join(OPT.out, "trace_%s.json" % tag)
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    with gzip.open(path + ".gz", "wt") as f:
        json.dump(trace, f)
    os.remove(path)
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu_ops = [e for e in ev if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    if not gpu:
        out("  profiler saw no GPU activity")
        return
    t_first = min(e["ts"] for e in gpu)
    t_last = max(e["ts"] + e["dur"] for e in gpu)
    allm = _intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    busy = _total(allm)
    out("  profiled run: GPU first->last %.1f ms, busy %.1f ms (%.0f%%), %d GPU activities"
        % ((t_last - t_first) / 1e3, busy / 1e3, 100 * busy / (t_last - t_first), len(gpu)))
    gaps = [(allm[i][1], allm[i + 1][0]) for i in range(len(allm) - 1)]
    big = [g for g in gaps if g[1] - g[0] > 20]
    out("  GPU idle gaps > 20 us: %d, total %.2f ms; gaps <= 20 us total %.2f ms"
        % (len(big), sum(b - a for a, b in big) / 1e3, sum(b - a for a, b in gaps if b - a <= 20) / 1e3))
    # what the host was doing during the 8 longest gaps (CPU ops overlapping them, by name)
    for a, b in sorted(big, key=lambda g: g[0] - g[1])[:8]:
        names = {}
        for e in cpu_ops:
            lo, hi = max(a, e["ts"]), min(b, e["ts"] + e["dur"])
            if lo < hi and e["dur"] < (b - a) * 4:
                names[e["name"]] = names.get(e["name"], 0) + (hi - lo)
        top = sorted(names.items(), key=lambda kv: -kv[1])[:6]
        out("    gap %.3f ms at +%.1f ms: %s" % ((b - a) / 1e3, (a - t_first) / 1e3,
                                                ", ".join("%s %.2f" % (n[:50], d / 1e3) for n, d in top)))
    streams = {}
    for e in gpu:
        streams.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append(e)
    for s, es in sorted(streams.items(), key=lambda kv: -len(kv[1])):
        m = _intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in es])
        copies = [e for e in es if e.get("cat") == "gpu_memcpy"]
        nbytes = sum(e.get("args", {}).get("bytes", 0) for e in copies)
        ctime = _total(_intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in copies]))
        out("  stream %s: %d activities, busy %.1f ms; copies %d, %.2f GiB in %.1f ms (%.1f GB/s while copying)"
            % (s, len(es), _total(m) / 1e3, len(copies), nbytes / 2 ** 30, ctime / 1e3,
               nbytes / ctime / 1e3 if ctime else 0))
    if len(streams) > 1:
        ms = sorted(streams.items(), key=lambda kv: -len(kv[1]))
        comp = _intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in ms[0][1]])
        for s, es in ms[1:]:
            m = _intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in es])
            out("  stream %s overlaps the main stream %.1f ms of its %.1f ms; main stream idle while it runs %.1f ms"
                % (s, _intersect(comp, m) / 1e3, _total(m) / 1e3, (_total(m) - _intersect(comp, m)) / 1e3))
        idle_both = (t_last - t_first) - busy
        out("  no stream busy: %.1f ms" % (idle_both / 1e3))
    avg = prof.key_averages()
    table = avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=55)
    out("  CPU ops by self time (one run):\n" + table)


def launch_sources(model, clip, size, batch):
    """Which Python lines launch the aten kernels of one patched step: one eager step of Accelerated KSampler
    (CUDA graphs off, everything else on) under a dispatch mode that counts every aten op on a CUDA tensor by
    op and the innermost project/ComfyUI frames that called it (Triton kernels are not aten ops: not listed)."""
    import collections
    import traceback
    import nodes
    from torch.utils._python_dispatch import TorchDispatchMode
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    counts = collections.Counter()
    skip = ("aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::t", "aten::transpose", "aten::permute",
            "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::reshape",
            "aten::detach", "aten::alias", "aten::split", "aten::chunk", "aten::narrow", "aten::empty",
            "aten::empty_strided", "aten::empty_like", "aten::unbind", "aten::split_with_sizes", "aten::is_pinned",
            "aten::_local_scalar_dense", "aten::lift_fresh", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type")

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = "aten::" + func.__name__.split(".")[0]
            cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in list(args) + list((kwargs or {}).values()))
            if cuda and name not in skip:
                frames = [f for f in traceback.extract_stack(limit=14)[:-1]
                          if "/torch/" not in f.filename and "profile_step" not in f.filename]
                where = " <- ".join("%s:%d %s" % (f.filename.split("/")[-1], f.lineno, f.name) for f in frames[-3:][::-1])
                counts[(name, where)] += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        pos = nodes.CLIPTextEncode().encode(clip, cb.POS)[0]
        neg = nodes.CLIPTextEncode().encode(clip, cb.NEG)[0]
        lat = nodes.EmptyLatentImage().generate(size, size, batch)[0]
        run = lambda: SDAccelKSampler().sample(model, 3, 1, 7.0, "euler", "normal", pos, neg, lat,  # noqa: E731
                                               cuda_graph=False)
        run()
        torch.cuda.synchronize()
        with Count():
            run()
    total = sum(counts.values())
    out("  aten ops on CUDA tensors in one eager step (CFG batch): %d; by op and caller:" % total)
    for (name, where), n in counts.most_common(60):
        out("   %4d x %-26s %s" % (n, name, where))


def main():
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    for tag in OPT.configs.split(","):
        kind, size, batch, budget = CONFIGS[tag]
        model, clip, vae = cb.load_family(ENV, OPT, kind, LOADED)
        mm.unload_all_models()
        mm.soft_empty_cache()
        settings = None
        if budget is not None:
            from sd_accel.hosts.comfyui.memory import pool_settings
            model = SDAccelVRAMPool().apply(model, budget_gib=budget, offload="lowvram")["result"][0]
            settings = pool_settings(model)

        def run(seed):
            return cb.run_graph(ENV, model, clip, vae, size, batch, seed, "ours", OPT.steps)
        out("== %s" % tag)
        for s in (1, 2):
            r = run(s)
            out("  warm run %d: %.1f it/s (%s)" % (s, OPT.steps / r["sample_s"], (r["line"] or "")[:300]))
            if settings is not None:
                out("    pool notes: %s" % "; ".join(settings.last_notes)[:600])
        if budget is None and tag == "sd15_512_b1":
            try:
                launch_sources(model, clip, size, batch)
            except Exception:  # noqa: BLE001 - a diagnosis: the timings below still run
                import traceback
                out("  launch_sources failed:\n" + traceback.format_exc())
        host_timeline(run)
        if budget is None and OPT.outside:
            outside_steps(model, clip, vae, size, batch)
        import gc
        graphs = [o for o in gc.get_objects() if isinstance(o, step_graphs.StepGraphs) and o.entries]
        if budget is None:   # a streamed graph replayed outside its run would read released host buffers
            replay_alone(graphs)
        profiled(run, tag)
        with open(os.path.join(OPT.out, "profile_%s.txt" % tag), "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
