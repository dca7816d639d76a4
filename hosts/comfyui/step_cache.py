"""Step cache (DeepCache, LOSSY, opt-in) on ComfyUI: per sampling run, each call full or cached.

Wiring on an accelerated clone (current ComfyUI: keyed wrappers):
  * a SAMPLER_SAMPLE wrapper makes one StepCacheRun per sampling run (engine/step_cache/run_state.py) and
    drops it when the run ends, on error too: nothing is kept between runs, prompts or models. It hands the
    sampler a callback that counts the sampler's steps before calling ComfyUI's own (previews, progress);
  * SD Accel's step (hosts/comfyui/accelerate.py) asks the run, outside any graph, which kind of call this
    is, and marks the call's transformer options: ("full",) or ("cached", feature). The mark is part of the
    call, so each kind is its own graph key (never a replay of the other kind), and the feature of a cached
    call is a graph input, copied in before each replay;
  * a DIFFUSION_MODEL wrapper (innermost) reads the mark: a full call runs ComfyUI's own forward and hands
    the deep feature back beside the UNet's output (part of what a graph captures and replays); a cached call
    runs the shallow blocks only (hosts/comfyui/step_cache_unet.py).
Refused, with one line and the whole UNet every step (lossless): ComfyUI without those wrappers (2024), a
diffusion model other than the ldm UNetModel (or a video one), a skip branch the UNet does not have
(at apply time); another pack's DIFFUSION_MODEL wrapper on a call, which decides itself how the UNet runs
(EasyCache) (per call, counted in the report).
"""
import logging
import threading

from ...engine.step_cache import schedule
from ...engine.step_cache.run_state import StepCacheRun
from . import step_cache_unet as unet_calls
from .step_wrappers import WRAPPER_KEY   # our wrappers' key, the step cache's DIFFUSION_MODEL wrapper's too

log = logging.getLogger("sd_accel")
MODES = schedule.MODES
RUN_KEY = "sd_accel_step_cache"        # the SAMPLER_SAMPLE wrapper's
CALL_OPTION = "sd_accel_step_cache"    # the transformer option that marks a call's kind
_local = threading.local()             # .runs: [(StepCache, run)], innermost last; .sinks: full calls' features


def call_kind(transformer_options):
    """"full", "cached" or None (not a step-cache call): for keys that must tell the kinds apart."""
    mark = (transformer_options or {}).get(CALL_OPTION)
    return mark[0] if mark else None


class StepCache:
    """One accelerated clone's step cache: its mode and skip branch, and what its last run did."""

    def __init__(self, mode, branch):
        self.mode, self.branch = mode, int(branch)
        self.finished, self.last = 0, None
        # the wrappers travel in every call's transformer options: they enter graph keys by what built them
        # (a bound method would enter by this object's attributes, which change from run to run)
        mark = ("step cache", mode, self.branch)
        self.sampler_sample = _inert(lambda *a, **k: self._sampler_sample(*a, **k), mark + ("sampler_sample",))
        self.diffusion_model = _inert(lambda *a, **k: self._diffusion_model(*a, **k), mark + ("diffusion_model",))

    def active_run(self):
        for owner, run in reversed(getattr(_local, "runs", ())):
            if owner is self:
                return run
        return None

    def _sampler_sample(self, executor, guider, sigmas, extra_args, callback, *args, **kwargs):
        """SAMPLER_SAMPLE wrapper: the run's state lives exactly as long as the sampler's run."""
        run = StepCacheRun(self.mode, int(sigmas.shape[-1]) - 1, self.branch)
        runs = _local.__dict__.setdefault("runs", [])
        runs.append((self, run))
        try:
            return executor(guider, sigmas, extra_args, _counting(callback, run), *args, **kwargs)
        finally:
            runs.remove((self, run))
            self._finish(run)

    def _finish(self, run):
        self.last = run.summary()
        self.finished += 1
        run.release()
        log.info("[SD Accel] %s", summary_line(self.last))

    def _diffusion_model(self, executor, x, timesteps=None, context=None, y=None, control=None,
                        transformer_options={}, **kwargs):  # noqa: B006 - ComfyUI's own signature
        """DIFFUSION_MODEL wrapper: a marked call runs its kind; any other passes through."""
        mark = transformer_options.get(CALL_OPTION)
        if not mark:
            return executor(x, timesteps, context, y, control, transformer_options, **kwargs)
        to = {k: v for k, v in transformer_options.items() if k != CALL_OPTION}
        unet = executor.class_obj
        if mark[0] == "cached":
            return unet_calls.shallow_forward(unet, x, timesteps, context, y, control, to, mark[1], self.branch,
                                              **kwargs)
        sinks = getattr(_local, "sinks", None)
        if sinks:
            to = unet_calls.recording(to, unet_calls.first_output(unet, self.branch), sinks[-1].append)
        return executor(x, timesteps, context, y, control, to, **kwargs)

    def wrap(self, step, foreign_wrappers):
        """SD Accel's step(call, args, kwargs, transformer_options) with each call of a run full or cached.
        `foreign_wrappers(transformer_options)`: other packs' DIFFUSION_MODEL wrappers on the call."""
        def step_with_cache(call, args, kwargs, transformer_options=None):
            run = self.active_run()
            if run is None or len(args) != 6 or transformer_options is None:
                return step(call, args, kwargs, transformer_options)
            foreign = foreign_wrappers(transformer_options)
            if foreign:
                run.refuse("another pack's DIFFUSION_MODEL wrapper (%s) decides how the UNet runs"
                           % ", ".join(map(str, foreign)))
                return step(call, args, kwargs, transformer_options)
            slot = _slot(args[0], transformer_options)
            feature = run.cached_feature(slot)
            if feature is not None:
                to = dict(transformer_options, **{CALL_OPTION: ("cached", feature)})
                out = step(call, args[:5] + (to,), kwargs, to)
                run.ran_cached()
                return out
            to = dict(transformer_options, **{CALL_OPTION: ("full",)})
            out, kept = step(_keeping_feature(call), args[:5] + (to,), kwargs, to)
            run.ran_full(slot, kept)
            return out
        return step_with_cache


def _inert(fn, mark):
    fn.sd_accel_inert = mark
    return fn


def _slot(x, transformer_options):
    """Calls whose deep features stand in for each other: the same batch shape and the same conds in it."""
    to = transformer_options
    return (tuple(x.shape), x.dtype, str(x.device), tuple(to.get("cond_or_uncond") or ()),
            tuple(to.get("uuids") or ()))


def _counting(callback, run):
    def on_step(*args, **kwargs):
        run.step_done()
        if callback is not None:
            return callback(*args, **kwargs)
        return None
    return on_step


def _keeping_feature(call):
    """`call` that returns (its output, the deep feature the DIFFUSION_MODEL wrapper kept during it)."""
    def full_call(*args, **kwargs):
        kept = []
        sinks = _local.__dict__.setdefault("sinks", [])
        sinks.append(kept)
        try:
            out = call(*args, **kwargs)
        finally:
            sinks.pop()
        return out, (kept[-1] if kept else None)
    return full_call


def unavailable(clone, branch):
    """Why the step cache cannot run on this clone, or None."""
    try:
        import comfy.patcher_extension as pe
        has = all(hasattr(pe.WrappersMP, w) for w in ("DIFFUSION_MODEL", "SAMPLER_SAMPLE"))
    except ImportError:
        has = False
    if not (has and hasattr(clone, "add_wrapper_with_key")):
        return ("this ComfyUI has no DIFFUSION_MODEL and SAMPLER_SAMPLE wrappers (ComfyUI 2024): the shallow "
                "blocks cannot run alone; the whole UNet runs every step")
    why = unet_calls.unsupported(clone.model.diffusion_model, branch)
    return None if why is None else why + "; the whole UNet runs every step"


def drop(clone):
    """Removes our step-cache wrappers from a clone (re-applying replaces them, never stacks them)."""
    wrappers = getattr(clone, "wrappers", None)
    if not wrappers:
        return
    import comfy.patcher_extension as pe
    for kind, key in ((pe.WrappersMP.SAMPLER_SAMPLE, RUN_KEY), (pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)):
        wrappers.get(kind, {}).pop(key, None)


def install(clone, options, info):
    """The clone's StepCache with its wrappers, or None: off, or refused (the reason in info["reasons"])."""
    drop(clone)
    mode = options.step_cache
    if schedule.parse(mode) is None:
        return None
    why = unavailable(clone, options.step_cache_branch)
    if why:
        info["reasons"]["step_cache"] = why
        log.warning("[SD Accel] step_cache %s refused: %s", mode, why)
        return None
    import comfy.patcher_extension as pe
    sc = StepCache(mode, options.step_cache_branch)
    clone.wrappers.setdefault(pe.WrappersMP.SAMPLER_SAMPLE, {})[RUN_KEY] = [sc.sampler_sample]
    clone.wrappers.setdefault(pe.WrappersMP.DIFFUSION_MODEL, {})[WRAPPER_KEY] = [sc.diffusion_model]
    info["step_cache"] = sc
    return sc


def finished_runs(info):
    sc = info.get("step_cache")
    return sc.finished if sc is not None else 0


def run_summary(info, finished_before):
    """The summary of the last run of the step cache since `finished_before`, else None."""
    sc = info.get("step_cache")
    if sc is None or sc.finished <= finished_before:
        return None
    return sc.last


def summary_line(s):
    """One line, LOSSY first: how many of the run's steps ran the shallow blocks only."""
    line = "step_cache %s (LOSSY, branch %d): %d of %d steps ran the shallow blocks only (%d full, %d cached calls)" % (
        s["mode"], s["branch"], s["cached_steps"], s["steps"], s["full_calls"], s["cached_calls"])
    if s["steps_reported"] == 0 and s["steps"] > 1:
        line += "; the sampler reported no steps, so every call ran in full"
    if s["refused"]:
        line += "; whole UNet for: " + "; ".join("%s (%d calls)" % kv for kv in s["refused"].items())
    return line
