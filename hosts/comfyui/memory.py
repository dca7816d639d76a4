"""ComfyUI host, memory side: what the VRAM Pool node (nodes/memory_nodes.py) sets up for the sampling runs of
one model, through ComfyUI's own model_management (its loader sees the budget and partially loads the model
the way --lowvram does). This file wires a run; the planner is engine/memory/vram_plan.py, the scopes on
model_management are memory_scopes.py, lowvram streaming is lowvram.py, the text encode is clip_stage.py.
The VAE decode under a budget is the separate VAE Decode (SD Accel) node (nodes/vae_nodes.py).

- budget_gib: checked against the model before sampling (the node's plan); during each sampling run of the
  returned model, `comfy.model_management.EXTRA_RESERVED_VRAM` is raised so the loader sees only the budget
  of the card, and restored afterwards. Needs a ComfyUI with keyed sampler wrappers and EXTRA_RESERVED_VRAM
  (0.3.x); on older ComfyUI the node says the budget is not enforced.
- offload=medvram: before sampling every other model is unloaded from the GPU, after sampling the model.
- offload=lowvram: ComfyUI partially loads the UNet under the budget minus the planner's streaming ring;
  once it has (a SAMPLER_SAMPLE wrapper, inside the run), what it left on the CPU is streamed unit by unit
  into fixed places of a GPU ring (one copy per unit, prefetch on a side stream) instead of being copied
  layer by layer at every use. Its cast path (`comfy_cast_weights`) then finds the weight already on the GPU
  and does not copy. Fixed places let the Accelerated KSampler's CUDA graphs capture the copies with the
  step. Removed after the run, on error too. CUDA only; elsewhere the run is offload=none and the notes say so.
- out of memory during a run: memory is freed and the run retried once with more offload (lowvram where it
  can run, and half the budget); a second one is an error naming the budget and what to change.
- host copies (offload medvram or lowvram, CUDA): before each run, the pooled model and every model ComfyUI
  has loaded on its device (text encoders, VAE) are mirrored (engine/memory/host_mirror.py): ComfyUI's moves
  off the GPU then point the weights back at pinned host copies instead of copying them out, and its moves to
  the GPU read from pinned memory. The models keep their copies (host memory of their size) while loaded.
- clip (optional): the pool's clip output encodes under the same budget, measured as the "text encode" stage;
  the next sampling run's report starts with it. The Accelerated KSampler shows that report.
- release_cache=after_run: the allocator's cached blocks are released after sampling (soft_empty_cache).
- expandable_segments: the CUDA allocator uses expandable segments during sampling (torch >= 2.1).
"""
import contextlib
import logging
from dataclasses import dataclass

import torch

from ...engine.graphs import eager
from ...engine.memory import stream_units, vram_plan
from ...engine.memory.vram_plan import GIB
from ...engine.reports import vram_report
from ...kernels.errors import first_line
from . import lowvram
from .memory_scopes import (activation_bytes, activation_estimate, budget_scope, budget_supported,
                            diffusion_model, expandable_segments_scope, mirror_models, model_management,
                            unload_others)

log = logging.getLogger("sd_accel")

WRAPPER_KEY = "sd_accel_vram_pool"
OFFLOAD = ("none", "medvram", "lowvram")
RELEASE = ("never", "after_run")


class PoolSettings:
    def __init__(self, budget_bytes, offload, release_cache, expandable_segments, plan):
        self.budget_bytes, self.offload, self.release_cache = budget_bytes, offload, release_cache
        self.expandable_segments, self.plan = expandable_segments, plan
        self.last_report, self.last_notes = None, []
        self.text_stage = None        # the "text encode" stage of the pool's CLIP (clip_stage): its largest since
        self.text_notes = []          # the last sampling run, joined to that run's report
        self.active = None            # during a run: the current Attempt
        self.pinned_cache = {}        # pinned host copies of streamed weights, kept across runs
        self.promoted_cache = {}      # the same for the blocks moved to the GPU for the run (promoted)
        self.host_copies = True       # offload medvram/lowvram: mirror the models' weights in pinned host memory
        self.stream_every_block = False   # tests: stream every block, on a CPU device or where ComfyUI loaded it
        self.last_streamer = None


@dataclass
class Attempt:
    """One try of a sampling run (the first, or the retry after an out-of-memory), for the SAMPLER_SAMPLE
    wrapper: its placement is decided once, before ComfyUI loads the model."""
    offload: str                        # as it runs: "lowvram" only where streaming can run
    placement: vram_plan.RunPlacement
    notes: list


def _oom_types(mm):
    types_ = [torch.cuda.OutOfMemoryError]
    t = getattr(mm, "OOM_EXCEPTION", None)
    if isinstance(t, type) and t is not Exception and t not in types_:
        types_.append(t)
    return tuple(types_)


def _cap_loader(stack, mm, device, total_bytes, placement, stream, notes):
    """Under a budget: ComfyUI's loader sees only `placement.loader_bytes` of the card during the run
    (lowvram: the budget less the streamed blocks in flight)."""
    budget = placement.budget_bytes
    if device.type != "cuda" and total_bytes is None:
        notes.append("budget: not applied (the model runs on %s)" % device.type)
        return
    total = total_bytes if total_bytes is not None else mm.get_total_memory(device)
    if budget >= total:
        notes.append("budget %.2f GiB >= the card's %.2f GiB: no cap" % (budget / GIB, total / GIB))
        return
    loader = placement.loader_bytes
    stack.enter_context(budget_scope(mm, loader, total))
    stack.enter_context(eager.under_vram_budget())
    notes.append("budget %.2f GiB of %.2f GiB" % (budget / GIB, total / GIB)
                 + (" (loader %.2f GiB, the rest for streaming)" % (loader / GIB) if stream else ""))


def _attempt(settings, patcher, run, mm, total_bytes, device, offload, budget, report, stage, notes):
    with contextlib.ExitStack() as stack:
        stream = offload == "lowvram"
        if stream:
            why = lowvram.streaming_unavailable(mm, patcher, device, settings)
            if why:
                notes.append("lowvram: off (%s); ran as offload=none" % why)
                stream = False
        reserve = activation_bytes(mm) if stream and hasattr(mm, "minimum_inference_memory") else None
        placement = vram_plan.place_run(settings.plan, budget, stream, reserve)
        if budget:
            _cap_loader(stack, mm, device, total_bytes, placement, stream, notes)
        if settings.expandable_segments:
            stack.enter_context(expandable_segments_scope(device, notes))
        if offload in ("medvram", "lowvram") and settings.host_copies:
            notes.append(mirror_models(mm, patcher, device))
        if offload == "medvram":
            if device.type == "cpu":
                notes.append("medvram: n/a (the model runs on cpu)")
            else:
                unload_others(mm, patcher, device)
                notes.append("medvram: other models unloaded before, this one after")
        settings.active = Attempt("lowvram" if stream else "none", placement, notes)
        try:
            with report.stage(stage, device):
                return run()
        finally:
            settings.active = None
            if offload == "medvram" and device.type != "cpu":
                mm.free_memory(1e30, device)


def _more_offload(settings, mm, patcher, device, total_bytes):
    """(offload, budget) for the retry after an out-of-memory: lowvram where streaming can run (else medvram
    on a GPU), at half the budget (half the card when there was none), never below the planner's minimum."""
    offload = settings.offload
    if lowvram.streaming_unavailable(mm, patcher, device, settings) is None:
        offload = "lowvram"
    elif device.type == "cuda":
        offload = "medvram"
    budget = settings.budget_bytes
    if device.type == "cuda" or total_bytes is not None:
        base = budget or (total_bytes if total_bytes is not None else mm.get_total_memory(device))
        floor = settings.plan.min_budget_bytes if settings.plan is not None else 0
        budget = max(int(base) // 2, floor)
    return offload, budget


def _gib(n):
    return "%.2f GiB" % (n / GIB) if n else "none (no cap)"


def run_in_pool(settings, patcher, run, mm=None, total_bytes=None, before_retry=None):
    """Runs `run()` (one sampling run of `patcher`) under the pool's settings; ComfyUI's globals are restored
    on return or error. An out-of-memory is caught once: memory freed, `before_retry()` called, and `run()`
    called again with more offload (see _more_offload); a second one raises a RuntimeError that names the
    budgets. Records a MemoryReport ("sampling", "sampling (retry)") and notes on `settings`."""
    mm = mm or model_management()
    device = torch.device(patcher.load_device)
    notes, report = list(settings.text_notes), vram_report.MemoryReport()
    if settings.text_stage is not None:        # the pool's text encode since the last run comes first
        report.record(settings.text_stage)
    settings.text_stage, settings.text_notes = None, []
    oom = _oom_types(mm)
    offload, budget = settings.offload, settings.budget_bytes
    try:
        try:
            return _attempt(settings, patcher, run, mm, total_bytes, device, offload, budget, report, "sampling",
                            notes)
        except oom as e:
            first = e
        retry_offload, retry_budget = _more_offload(settings, mm, patcher, device, total_bytes)
        mm.free_memory(1e30, device)
        mm.soft_empty_cache()
        what = "out of memory at budget %s, offload %s (%s): memory freed, retried once with offload %s, budget %s" % (
            _gib(budget), offload, first_line(first, 120),
            retry_offload, _gib(retry_budget))
        notes.append(what)
        log.warning("[SD Accel] VRAM Pool: %s", what)
        if before_retry is not None:
            before_retry()
        try:
            return _attempt(settings, patcher, run, mm, total_bytes, device, retry_offload, retry_budget, report,
                            "sampling (retry)", notes)
        except oom as e:
            raise RuntimeError(
                "VRAM Pool: out of memory twice: at budget %s with offload %s, then at %s with offload %s. "
                "Lower the resolution or batch size, set offload to lowvram with a smaller budget_gib (the "
                "minimum for this model is %s), or close other programs using the GPU." % (
                    _gib(budget), offload, _gib(retry_budget), retry_offload,
                    _gib(settings.plan.min_budget_bytes) if settings.plan is not None else "in the node's plan")
            ) from e
    finally:
        if settings.release_cache == "after_run":
            mm.soft_empty_cache()
            notes.append("cache released")
        settings.last_report, settings.last_notes = report.to_dict(), notes
        log.info("[SD Accel] VRAM Pool: %s | %s", report.summary(), "; ".join(notes) or "defaults")


def pool_settings(model):
    """The PoolSettings a VRAM Pool put on `model` (a ModelPatcher), or None."""
    get = getattr(model, "get_wrappers", None)
    if get is None:
        return None
    try:
        import comfy.patcher_extension as pe
        wrappers = get(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    except Exception:  # noqa: BLE001 - a host without keyed wrappers carries no pool
        return None
    return getattr(wrappers[0], "sd_accel_pool", None) if wrappers else None


def _outer_sample_wrapper(settings):
    def wrapper(executor, *args, **kwargs):
        guider = executor.class_obj
        patcher = guider.model_patcher
        saved = {k: [c.copy() for c in v] for k, v in guider.conds.items()} if isinstance(
            getattr(guider, "conds", None), dict) else None

        def before_retry():     # the run processed the conds in place of the guider's copies: start afresh
            if saved is not None:
                guider.conds = {k: [c.copy() for c in v] for k, v in saved.items()}
        return run_in_pool(settings, patcher, lambda: executor(*args, **kwargs), before_retry=before_retry)
    wrapper.sd_accel_pool = settings
    wrapper.sd_accel_inert = ("vram pool", "outer sample")   # around sampling: no part of a step's graph
    return wrapper


def _sampler_sample_wrapper(settings):
    """Runs after ComfyUI loaded the models (inside outer_sample): where lowvram streaming starts and ends."""
    def wrapper(executor, *args, **kwargs):
        active = settings.active
        if not active or active.offload != "lowvram":
            return executor(*args, **kwargs)
        noise = args[4] if len(args) > 4 else kwargs.get("noise")
        with lowvram.stream_scope(settings, args[0].model_patcher, active.placement, active.notes,
                                  getattr(noise, "shape", None)):
            return executor(*args, **kwargs)
    wrapper.sd_accel_pool = settings
    wrapper.sd_accel_inert = ("vram pool", "sampler sample")
    return wrapper


def _node_plan(mm, model, budget):
    """(the node's residency plan at `budget`, notes), or a ValueError naming the minimum budget."""
    sizes = stream_units.unet_block_sizes(diffusion_model(model))
    try:
        plan, notes = vram_plan.plan_for_budget(sizes, budget, activation_estimate(mm, model))
    except vram_plan.BudgetTooSmall as e:
        raise ValueError("VRAM Pool: %s. Raise budget_gib to at least %.2f, or set it to 0 (no cap)."
                         % (e, e.needed / GIB)) from e
    for note in notes:
        log.info("[SD Accel] VRAM Pool: %s", note)
    return plan, notes


def make_pool(model, budget_gib, offload, release_cache, expandable_segments):
    """(clone of `model` carrying the pool's wrappers, report line, UI dict): the VRAM Pool node's work."""
    mm = model_management()
    budget = int(round(float(budget_gib) * GIB))
    plan, notes = _node_plan(mm, model, budget)
    settings = PoolSettings(budget, offload, release_cache, bool(expandable_segments), plan)
    clone = model.clone()
    unsupported = budget_supported(mm, clone)
    if unsupported is None:
        import comfy.patcher_extension as pe
        clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, _outer_sample_wrapper(settings))
        clone.add_wrapper_with_key(pe.WrappersMP.SAMPLER_SAMPLE, WRAPPER_KEY, _sampler_sample_wrapper(settings))
    else:
        notes.append("NOT enforced: %s; the plan below is advisory" % unsupported)
        log.warning("[SD Accel] VRAM Pool settings not enforced: %s", unsupported)
    streaming = None
    if offload == "lowvram":
        why = lowvram.streaming_unavailable(mm, clone, torch.device(clone.load_device))
        streaming = why is None
        if why:
            notes.append("lowvram: block streaming off (%s); runs as offload=none" % why)
            log.warning("[SD Accel] VRAM Pool: lowvram block streaming off (%s); runs as offload=none", why)
    ui = plan.to_dict()
    ui.update(resident_count=len(plan.resident), streamed_count=len(plan.streamed), offload=offload,
              release_cache=release_cache, expandable_segments=bool(expandable_segments),
              enforced=unsupported is None, streaming=streaming, notes=notes)
    placement = ("ComfyUI's partial loading, the rest streamed" if streaming else "ComfyUI's partial loading")
    line = ("VRAM Pool: plan for block streaming: %s (placement: %s); offload %s, "
            "release cache %s, expandable segments %s%s") % (
        plan.summary(), placement, offload, release_cache, "on" if expandable_segments else "off",
        " | " + "; ".join(notes) if notes else "")
    log.info("[SD Accel] %s", line)
    return clone, line, ui
