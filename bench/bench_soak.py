#!/usr/bin/env python3
"""Soak: many prompts of changing size and batch in one server process, stock ComfyUI vs SD Accel's VRAM
Pool, one after the other in one process, same seeds (issue 4: "100 prompts cycling 512/768/1024 and batch
1/2/4 in one server: no OOM, reserved/allocated <= 1.25 at the end, no growth of reserved memory over the
last 50 prompts; stock measured the same way"). Config `sd15_soak_100`.

GPU machine only (--smoke: a CPU plumbing check). ComfyUI's own nodes in-process, booted in main.py's order
(comfy_bench.boot), so its default cudaMallocAsync allocator is in force; a random full-size SD1.5 checkpoint
built here (dev/fixtures.py). Each prompt is the whole graph, as comfy_bench.run_graph runs it:
CLIPTextEncode x2 -> EmptyLatentImage -> sampler -> decoder. Variants:
  stock  KSampler on the model as loaded;
  ours   SDAccelVRAMPool(budget 0, offload none, release_cache after_run, expandable_segments where the
         allocator has them) -> Accelerated KSampler with its defaults (fused kernels, CUDA graph,
         channels_last) -> VAE Decode (SD Accel) with its defaults (cached blocks released after the decode):
         the settings for a long-running server (cached blocks released after sampling and after decoding).
The models are unloaded and the cache emptied between variants. The prompts cycle through the 9
(size, batch) pairs in a fixed order that alternates large and small (CYCLE), seeds 1000+i for both.

Between prompts, ComfyUI's prompt worker is emulated (main.py: gc.collect() + soft_empty_cache() after a
prompt when the last one was >= 10 s ago; --no-server-gc turns it off); an out-of-memory is caught as the
executor does (unload all models), counted, and the soak goes on. After each prompt, before that gc:
  allocated  memory_stats()["allocated_bytes.all.current"]   (cudaMallocAsync: the pool's used bytes)
  reserved   memory_stats()["reserved_bytes.all.current"]    (cudaMallocAsync: the pool's reserved bytes,
             cudaMemPoolAttrReservedMemCurrent; native: the caching allocator's segments)
  peak       max_memory_allocated over the prompt's sampling + decode (reset per prompt)
  device     total - free from cudaMemGetInfo: everything the process holds on the card (context, cuBLAS
             workspaces, CUDA-graph memory, which under cudaMallocAsync lives in the driver's graph pool and
             is not in `reserved`)
  graph_mem  cudaDeviceGetGraphMemAttribute(ReservedMemCurrent), where libcudart can be reached
Per variant: OOM count, reserved/allocated after the last prompt, growth = max reserved over the second half
of the prompts minus max reserved over the first half (the cycle repeats, so a steady server gives <= 0), the
same for device memory, total seconds. One JSON line per run to $OUT/results.jsonl (fields of
../shared/BENCH.md where they apply, plus the soak fields), every prompt's numbers to $OUT/soak_trace.jsonl,
and a table.

  python3 bench/bench_soak.py --comfy-dir vendor/ComfyUI --out $OUT [--prompts 100] [--steps 10] [--deadline 390]
  python3 bench/bench_soak.py --smoke          # CPU: tiny UNet, 64/96/128 px, 2 steps, 9 prompts
"""
import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

CONFIG = "sd15_soak_100"
GIB = 2 ** 30
# (size, batch): each size and each batch once per three prompts, large and small alternating
CYCLE = [(512, 1), (1024, 4), (768, 2), (512, 4), (1024, 1), (768, 4), (512, 2), (1024, 2), (768, 1)]
SMOKE_SIZE = {512: 64, 768: 96, 1024: 128}
SERVER_GC_INTERVAL = 10.0      # main.py's gc_collect_interval

ap = argparse.ArgumentParser()
cb.add_common_args(ap, deadline=390.0)
ap.add_argument("--prompts", type=int, default=100, help="prompts per variant")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--variants", default="stock,ours", help="run order; both in one process")
ap.add_argument("--expandable", choices=("auto", "on", "off"), default="auto",
                help="the pool's expandable_segments; auto = on only under the native allocator (cudaMallocAsync "
                     "has no expandable segments: the setting is the native caching allocator's)")
ap.add_argument("--no-server-gc", action="store_true", help="do not emulate the prompt worker's periodic gc")
OPT = ap.parse_args()
if OPT.smoke:
    OPT.steps = min(OPT.steps, 2)
    OPT.prompts = min(OPT.prompts, 9)
PRESET = "tiny" if OPT.smoke else "sd15"
ENV = cb.boot(OPT, ("checkpoints",))
torch, nodes, mm, fixtures = ENV.torch, ENV.nodes, ENV.mm, ENV.fixtures
say = cb.say


def allocator():
    if not ENV.cuda:
        return "n/a (cpu)"
    backend = torch.cuda.get_allocator_backend()
    return "cudaMallocAsync (ComfyUI default)" if backend == "cudaMallocAsync" else backend + " (--disable-cuda-malloc)"


def load():
    name = "random_sd15_%s_fp16.safetensors" % PRESET
    path = os.path.join(OPT.work, "checkpoints", name)
    fixtures.ensure(path, fixtures.build_checkpoint, OPT.comfy_dir, "sd15", PRESET, path, 1234)
    with torch.inference_mode():
        return nodes.CheckpointLoaderSimple().load_checkpoint(name)[:3]


def graph_mem_bytes():
    return cb.graph_mem_bytes(ENV.cuda)


def memory():
    if not ENV.cuda:
        return {"allocated": 0, "reserved": 0, "peak": 0, "device": 0, "graph_mem": None}
    torch.cuda.synchronize()
    st = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": st.get("allocated_bytes.all.current", 0), "reserved": st.get("reserved_bytes.all.current", 0),
            "peak": torch.cuda.max_memory_allocated(), "device": total - free, "graph_mem": graph_mem_bytes()}


def is_oom(e):
    types_ = tuple(t for t in (torch.cuda.OutOfMemoryError, getattr(mm, "OOM_EXCEPTION", None))
                   if isinstance(t, type) and t is not Exception)
    return isinstance(e, types_) or "out of memory" in str(e).lower()


def pool_model(model):
    from sd_accel.hosts.comfyui.memory import WRAPPER_KEY
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    import comfy.patcher_extension as pe
    exp = OPT.expandable == "on" or (OPT.expandable == "auto" and ENV.cuda
                                     and torch.cuda.get_allocator_backend() == "native")
    res = SDAccelVRAMPool().apply(model, budget_gib=0.0, offload="none", release_cache="after_run",
                                  expandable_segments=exp)
    clone = res["result"][0]
    wrappers = clone.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY) if hasattr(clone, "get_wrappers") else []
    settings = wrappers[0].sd_accel_pool if wrappers else None
    return clone, settings, exp, res["ui"]["text"][0]


def soak(variant, model, clip, vae, t_end, trace):
    """Runs the prompts of one variant; returns its per-prompt records and counters."""
    mm.unload_all_models()           # each variant starts as a fresh server would: nothing loaded, cache empty
    gc.collect()
    mm.soft_empty_cache()
    settings, notes = None, []
    if variant == "ours":
        model, settings, exp, plan_line = pool_model(model)
        say("pool", plan_line)
        notes.append("pool: budget 0, offload none, release_cache after_run, expandable_segments %s; VAE Decode "
                     "(SD Accel) releasing after the decode" % ("on" if exp else "off"))
    sampler = "ours" if variant == "ours" else "stock"
    recs, ooms, errors, retries, fallbacks, line = [], 0, 0, 0, 0, None
    pool_notes = set()
    last_gc = time.perf_counter()
    t0 = time.perf_counter()
    for i in range(OPT.prompts):
        if time.time() > t_end:
            notes.append("stopped at the deadline after %d prompts" % i)
            say("DEADLINE", variant, "after %d prompts" % i)
            break
        size, batch = CYCLE[i % len(CYCLE)]
        px = SMOKE_SIZE[size] if OPT.smoke else size
        if ENV.cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        oom, err, line = False, None, None
        try:
            r = cb.run_graph(ENV, model, clip, vae, px, batch, 1000 + i, sampler, OPT.steps,
                             decoder="ours" if variant == "ours" else "stock")
            line = r["line"]
            del r
        except Exception as e:  # noqa: BLE001 - a soak goes on, as the server does
            if is_oom(e):
                oom, ooms = True, ooms + 1
            else:
                errors += 1
                err = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                if errors <= 3:
                    say("ERROR", variant, i, traceback.format_exc())
            if oom:
                say("OOM", variant, i, size, batch, str(e).splitlines()[0][:200] if str(e) else "")
                mm.unload_all_models()   # what ComfyUI's executor does after an OOM
        dt = time.perf_counter() - t
        m = memory()
        if settings is not None:
            for n in settings.last_notes:
                if "out of memory" in n:
                    retries += 1
                elif n != "cache released":
                    pool_notes.add(n)
            settings.last_notes = []
        if line and "accelerated run failed" in line:
            fallbacks += 1
        rec = dict(variant=variant, i=i, size=px, batch=batch, s=round(dt, 3), oom=oom, error=err,
                   allocated_gib=round(m["allocated"] / GIB, 4), reserved_gib=round(m["reserved"] / GIB, 4),
                   peak_gib=round(m["peak"] / GIB, 4), device_gib=round(m["device"] / GIB, 4),
                   graph_mem_gib=None if m["graph_mem"] is None else round(m["graph_mem"] / GIB, 4))
        recs.append(rec)
        trace.write(json.dumps(rec) + "\n")
        if i < 3 or i % 10 == 9 or oom or err:
            say(variant, "%3d %4dpx b%d %6.2fs alloc %.2f res %.2f peak %.2f dev %.2f graph %s GiB%s" % (
                i, px, batch, dt, rec["allocated_gib"], rec["reserved_gib"], rec["peak_gib"], rec["device_gib"],
                rec["graph_mem_gib"], " OOM" if oom else (" ERR" if err else "")))
        now = time.perf_counter()
        if not OPT.no_server_gc and now - last_gc > SERVER_GC_INTERVAL:    # main.py's prompt_worker
            gc.collect()
            mm.soft_empty_cache()
            last_gc = now
    total = time.perf_counter() - t0
    if pool_notes:
        notes.append("pool notes: " + "; ".join(sorted(pool_notes)))
    if line:
        notes.append("last report: " + line[:300])
    if errors:
        notes.append("%d prompts failed with errors other than out of memory" % errors)
    return dict(recs=recs, ooms=ooms, errors=errors, retries=retries, fallbacks=fallbacks, seconds=total,
                notes=notes)


def summarize(res):
    recs = res["recs"]
    out = dict(prompts=len(recs), oom=res["ooms"], seconds=res["seconds"], ratio=None, growth=None,
               dev_growth=None, final_res=None, final_alloc=None, max_res=None, peak=None, final_graph=None)
    if not recs or not ENV.cuda:      # CPU smoke: no allocator figures
        return out
    last = recs[-1]
    out.update(final_res=last["reserved_gib"], final_alloc=last["allocated_gib"], final_dev=last["device_gib"],
               final_graph=last["graph_mem_gib"], max_res=max(r["reserved_gib"] for r in recs),
               peak=max(r["peak_gib"] for r in recs))
    if last["allocated_gib"] > 0:
        out["ratio"] = last["reserved_gib"] / last["allocated_gib"]
    half = len(recs) // 2
    if half:
        first, second = recs[:half], recs[half:]
        out["growth"] = max(r["reserved_gib"] for r in second) - max(r["reserved_gib"] for r in first)
        out["dev_growth"] = max(r["device_gib"] for r in second) - max(r["device_gib"] for r in first)
    return out


def r3(x):
    return None if x is None else round(x, 3)


def main():
    env = cb.versions(ENV, OPT.comfy_dir)
    alloc = allocator()
    say("ENV", json.dumps(env), "allocator:", alloc, "PYTORCH_CUDA_ALLOC_CONF:", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    model, clip, vae = load()
    variants = [v for v in OPT.variants.split(",") if v]
    results = {}
    with open(os.path.join(OPT.out, "soak_trace.jsonl"), "a") as trace:
        for k, v in enumerate(variants):
            share = (OPT.deadline - (time.time() - cb.T0)) / (len(variants) - k)   # equal time left per variant
            res = soak(v, model, clip, vae, time.time() + share, trace)
            results[v] = (res, summarize(res))
            s = results[v][1]
            say("DONE", v, "%d prompts, %d OOM, %.1fs, reserved/allocated %s, growth %s GiB" % (
                s["prompts"], s["oom"], s["seconds"], r3(s["ratio"]), r3(s["growth"])))
    rec = dict(env, date=datetime.date.today().isoformat(), config=CONFIG, steps=OPT.steps, sampler="euler",
               scheduler="normal", cfg=7.0, budget_gib=0.0, allocator=alloc,
               cycle=[[SMOKE_SIZE[s] if OPT.smoke else s, b] for s, b in CYCLE], server_gc=not OPT.no_server_gc)
    notes = []
    for v in variants:
        res, s = results[v]
        tag = "stock" if v == "stock" else "ours"
        rec.update({
            "prompts_%s" % tag: s["prompts"], "oom_count_%s" % tag: s["oom"],
            "reserved_over_allocated_%s" % tag: r3(s["ratio"]), "reserved_growth_gib_%s" % tag: r3(s["growth"]),
            "device_growth_gib_%s" % tag: r3(s["dev_growth"]), "final_reserved_gib_%s" % tag: r3(s["final_res"]),
            "final_allocated_gib_%s" % tag: r3(s["final_alloc"]), "max_reserved_gib_%s" % tag: r3(s["max_res"]),
            "final_graph_mem_gib_%s" % tag: r3(s["final_graph"]), "%s_peak_gib" % tag: r3(s["peak"]),
            "soak_s_%s" % tag: round(s["seconds"], 1)})
        if tag == "ours":
            rec.update(oom_retries_ours=res["retries"], fallbacks_ours=res["fallbacks"])
        notes.append("%s: %s" % (v, "; ".join(res["notes"]) or "-"))
    rec["notes"] = ("reserved = memory_stats reserved_bytes.all.current, allocated = allocated_bytes.all.current, "
                    "after the last prompt's decode, before any gc; growth = max reserved over the second half of "
                    "the prompts minus over the first half | " + " | ".join(notes))
    with open(os.path.join(OPT.out, "results.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    say("RESULT", json.dumps(rec))
    print("%-8s %7s %5s %9s %9s %9s %8s %9s %9s %9s %8s" % (
        "variant", "prompts", "OOM", "res/alloc", "final res", "max res", "growth", "dev grow", "peak", "graph",
        "seconds"))
    fmt = lambda x, f="%.3f": "-" if x is None else f % x  # noqa: E731
    for v in variants:
        s = results[v][1]
        print("%-8s %7d %5d %9s %9s %9s %8s %9s %9s %9s %8.1f" % (
            v, s["prompts"], s["oom"], fmt(s["ratio"]), fmt(s["final_res"]), fmt(s["max_res"]), fmt(s["growth"]),
            fmt(s["dev_growth"]), fmt(s["peak"]), fmt(s["final_graph"]), s["seconds"]))
    print("target (issue 4): 0 OOM, res/alloc <= 1.25 after the last prompt, growth <= 0 GiB (GiB columns)")


if __name__ == "__main__":
    main()
