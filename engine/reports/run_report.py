"""The per-run report that Accelerated KSampler and Apply SD Accel show: speed, memory, what ran."""
import time

import torch

from ...kernels import _launch
from ..fp8.support import LOSSY_NOTE

LOSSY_OPS = ("fp8_linear",)   # ops that change the image: labelled LOSSY wherever they are listed
# a host reason under this key is why SD Accel left the whole model alone (torch.compile in the graph, say): the
# report then says that one line instead of what each option found
WHOLE_MODEL = "SD Accel"


class RunTimer:
    """Times a sampling call on the host clock, synchronising the GPU so queued work is counted."""

    def __init__(self, device=None):
        self.cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        self.peak_bytes = torch.cuda.max_memory_allocated() if self.cuda else None


def compile_snapshot():
    """Kernels compiled ahead so far and the seconds it took (kernels/_compile_ahead.run_compiling_ahead)."""
    return _launch.first_launches["ahead"], _launch.first_launches["ahead_seconds"]


def compile_note(before, after):
    """The note for a run that compiled Triton kernels (a cold cache: the run's extra seconds), else None."""
    n, secs = after[0] - before[0], after[1] - before[1]
    if n <= 0:
        return None
    return ("first run of this shape: %d Triton kernels compiled in parallel (%.1f s; kept in Triton's cache "
            "for later runs and starts)" % (n, secs))


def build(steps, timer, kernels, graphs, options, notes=(), host_reasons=None, step_cache=None):
    """A JSON-able dict: it_s, seconds, peak_vram_gib, ran, fell_back ({what: why}), graphs, notes.
    `host_reasons`: {what: why} the host knows better than the counts (why the attention backend could act in
    no block, why nothing was fused); each replaces the generic reason of a `fell_back` entry of that name (one with
    no such entry becomes a note), and one under WHOLE_MODEL is the report's only `fell_back` entry.
    `step_cache`: the run's step-cache summary (engine/step_cache/run_state.summary), None where none ran."""
    ran, fell_back, notes = [], {}, list(notes)
    whole = (host_reasons or {}).get(WHOLE_MODEL)
    if whole:
        return _report(steps, timer, ran, {WHOLE_MODEL: whole}, graphs, notes, step_cache)
    for op, e in sorted(kernels.items()):
        if e["fused"]:
            ran.append("%s%s x%d" % (op, " (LOSSY)" if op in LOSSY_OPS else "", e["fused"]))
        if e["fallback"]:
            fell_back[op] = "; ".join(e["reasons"]) or "not eligible"
    stock_calls = (graphs or {}).get("stock_path", 0)
    if options.get("fused_kernels") and stock_calls:
        fell_back["fused kernels (some calls)" if kernels else "fused kernels"] = (
            "%d step call%s ran the stock modules: faster than the fused ones where no graph runs (%s)"
            % (stock_calls, "" if stock_calls == 1 else "s", (graphs or {}).get("eager_reason") or "eager"))
    elif options.get("fused_kernels") and not kernels:
        fell_back["fused kernels"] = "no fused module was called (no eligible module found)"
    if graphs:
        refused = graphs.get("refused") or {}
        if graphs.get("replays"):
            ran.append("cuda_graph (%d replays, %d captures)" % (graphs["replays"], graphs["captures"]))
            if refused:
                fell_back["cuda_graph (some calls)"] = _refusals(refused)
        elif options.get("cuda_graph"):
            fell_back["cuda_graph"] = _refusals(refused) if refused else (graphs.get("eager_reason") or "no replay")
    backend = options.get("attention", "auto")
    if backend != "auto" and "attention_" + backend not in kernels:   # "auto" is the host's own attention
        fell_back["attention_" + backend] = "no attention call went through it"
    if options.get("precision") == "fp8":
        if (kernels.get("fp8_linear") or {}).get("fused"):
            notes.append(LOSSY_NOTE)
        else:
            fell_back["precision fp8"] = "no FP8 layer was called"
    if options.get("channels_last"):
        # conv weights go to channels_last before a model's first capture, on a GPU only: eager steps keep
        # the layout stock's modules are fastest on
        if not timer.cuda:
            fell_back["channels_last"] = "CPU run: conv weights are converted on a GPU only"
        elif (graphs or {}).get("replays"):
            ran.append("channels_last")
        else:
            fell_back["channels_last"] = "used inside CUDA graphs only, and none ran"
    _step_cache(ran, fell_back, options.get("step_cache"), step_cache)
    for k, why in (host_reasons or {}).items():
        if k in fell_back:
            fell_back[k] = why
        else:   # a choice the host made that no count shows (fp8-stored weights kept as stored, say)
            notes.append("%s: %s" % (k, why))
    for k in ("fused_kernels", "cuda_graph", "channels_last"):
        if not options.get(k):
            fell_back.setdefault(k, "off")
    return _report(steps, timer, ran, fell_back, graphs, notes, step_cache)


def _report(steps, timer, ran, fell_back, graphs, notes, step_cache):
    return {"it_s": round(steps / timer.seconds, 3) if timer.seconds > 0 else None,
            "seconds": round(timer.seconds, 4),
            "steps": steps,
            "peak_vram_gib": round(timer.peak_bytes / 2 ** 30, 3) if timer.peak_bytes is not None else None,
            "ran": ran, "fell_back": fell_back, "graphs": graphs, "notes": notes,
            "step_cache": step_cache}


def _step_cache(ran, fell_back, mode, summary):
    """The step cache's entry, which says LOSSY wherever it ran: how many steps ran the shallow blocks only."""
    if not mode or mode == "off":
        return
    refused = (summary or {}).get("refused") or {}
    if summary and summary["cached_steps"]:
        ran.append("step_cache %s (LOSSY: %d of %d steps ran the shallow blocks only, branch %d)"
                   % (mode, summary["cached_steps"], summary["steps"], summary["branch"]))
        if refused:
            fell_back["step_cache (some calls)"] = _refusals(refused).replace("eager", "whole UNet")
    elif summary is None:
        fell_back["step_cache"] = "no sampling run of this model went through it"
    elif refused:
        fell_back["step_cache"] = _refusals(refused).replace("eager", "whole UNet")
    else:
        fell_back["step_cache"] = "no step ran cached (%d steps, %d reported by the sampler)" % (
            summary["steps"], summary["steps_reported"])


def _refusals(refused):
    """One line: why calls ran without graphs, most frequent first."""
    parts = sorted(refused.items(), key=lambda kv: -kv[1])
    return "; ".join("%s (%d call%s, eager)" % (why, n, "" if n == 1 else "s") for why, n in parts)


def one_line(r):
    vram = "%.2f GiB" % r["peak_vram_gib"] if r["peak_vram_gib"] is not None else "n/a (CPU)"
    ran = ", ".join(r["ran"]) or "stock path only"
    fb = "; ".join("%s: %s" % kv for kv in r["fell_back"].items()) or "nothing"
    return "%.2f it/s, %.2f s, peak VRAM %s | ran: %s | fell back: %s" % (
        r["it_s"] or 0.0, r["seconds"], vram, ran, fb)
