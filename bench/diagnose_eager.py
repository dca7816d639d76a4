#!/usr/bin/env python3
"""Where an accelerated run without graphs spends the time stock does not: a diagnosis, not a benchmark (nothing
for results.jsonl; bench_patches.py records `ours_eager_its`).

SD1.5 512² b1, 20 steps euler, one process. Four variants on one loaded model: stock KSampler and ours with
cuda_graph off on the plain model, then stock and ours (its defaults: the capture is refused) on a clone with
dev/patch_nodes.py's capture-breaking patch. After two warm-up runs each, three alternating timed runs (median
it/s), then one run of each under cProfile: its functions by own time, and the sampler call's share spent inside
the UNet step (ComfyUI's `apply_model`) against the rest. The GPU's busy time over one run (torch.profiler's CUDA
kernel total) says whether the run is bound by the host or the GPU.

  python3 bench/diagnose_eager.py --comfy-dir vendor/ComfyUI --out $OUT
  python3 bench/diagnose_eager.py --smoke --steps 2 --reps 1 --out /tmp/diagnose_eager   (CPU plumbing check)
  python3 bench/diagnose_eager.py --comfy-dir vendor/ComfyUI --out $OUT --patch LazyCache   (on a patched model)
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
cb.add_common_args(ap)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--patch", default=None,
                help="a dev/patch_nodes.py case (e.g. LazyCache, EasyCache) applied to the model of every variant")
ap.add_argument("--fingerprint", action="store_true",
                help="also: per step of ours with graphs (plain and refused), whether the weights' fingerprint "
                     "came from its per-run cache, and on a miss which check failed")
OPT = ap.parse_args()
ENV = cb.boot(OPT, ("checkpoints",))
sys.path.insert(0, os.path.join(cb.REPO, "dev"))
import patch_nodes  # noqa: E402
say = cb.say
torch = ENV.torch


def variants():
    model, clip, vae = cb.load_family(ENV, OPT, "sd15", {})
    if OPT.patch:
        model = patch_nodes.apply_case(model, patch_nodes.cases(64 if OPT.smoke else 512)[OPT.patch])
    broken = patch_nodes.add_capture_breaking_patch(model)
    return [("stock_plain", model, "stock", None), ("ours_nographs_plain", model, "ours", {"cuda_graph": False}),
            ("stock_uncapturable", broken, "stock", None), ("ours_uncapturable", broken, "ours", None)], clip, vae


def run(v, clip, vae, seed):
    _, model, sampler, accel = v
    return cb.run_graph(ENV, model, clip, vae, 64 if OPT.smoke else 512, 1, seed, sampler, OPT.steps, accel=accel)


def gpu_busy_ms(v, clip, vae):
    if not ENV.cuda:
        return 0.0
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(v, clip, vae, 7)
    return sum(e.device_time_total for e in prof.key_averages()
               if e.device_type is not None and "CUDA" in str(e.device_type) and e.device_time_total) / 1000.0


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
    return out["sample_s"], inside, text.getvalue()


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
    lines = []
    for v in vs:
        med = statistics.median(times[v[0]])
        busy = gpu_busy_ms(v, clip, vae)
        sample_s, inside, text = profiled(v, clip, vae)
        lines.append("%-22s %7.2f it/s  sampling %.3f s  GPU busy %.1f ms  under cProfile %.3f s, apply_model "
                     "cumulative %.3f s" % (v[0], OPT.steps / med, med, busy, sample_s, inside))
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
