"""VRAM Pool: a VRAM budget and memory hygiene for the sampling runs of one model, through ComfyUI's own
model_management (its loader sees the budget and partially loads the model the way --lowvram does).

What is wired now, and how (the rest of issue #4 is planned, and not offered as an option):
- budget_gib: checked against the model before sampling (engine/vram_plan.py); during each sampling run of
  the returned model, `comfy.model_management.EXTRA_RESERVED_VRAM` is raised so the loader sees only the
  budget of the card, and restored afterwards. Needs a ComfyUI with keyed sampler wrappers and
  EXTRA_RESERVED_VRAM (0.3.x); on older ComfyUI the node says the budget is not enforced.
- offload=medvram: before sampling every other model is unloaded from the GPU, after sampling the model.
- release_cache=after_run: the allocator's cached blocks are released after sampling (soft_empty_cache).
- expandable_segments: the CUDA allocator uses expandable segments during sampling (torch >= 2.1).
"""
import contextlib
import logging
import os

import torch

from ..engine import vram_plan, vram_report

log = logging.getLogger("sd_accel")

GIB = 2 ** 30
WRAPPER_KEY = "sd_accel_vram_pool"
PREFETCH_DEPTH = 1
OFFLOAD = ("none", "medvram")          # lowvram block streaming is planned (issue #4), not offered yet
RELEASE = ("never", "after_run")

INPUTS = {
    "model": ("MODEL", {"tooltip": "The model whose sampling runs the pool governs. Passed through on a clone: "
                        "the input model and other samplers are untouched."}),
    "budget_gib": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.25, "tooltip":
                   "VRAM the sampling run may use, in GiB; 0 = no cap. Checked before sampling: a budget below "
                   "what the model can run in stops with the minimum needed. While sampling, ComfyUI's loader "
                   "sees only this much of the card and keeps the rest of the weights in system RAM (its own "
                   "partial loading, slower). Needs ComfyUI 0.3.x; older versions are told it is not enforced."}),
    "offload": (list(OFFLOAD), {"default": "none", "tooltip":
                "none: ComfyUI's usual placement. medvram: one model on the GPU at a time: before sampling "
                "every other model (text encoder, VAE, other UNets) is unloaded, after sampling this model is "
                "unloaded so the VAE decode has the card. (lowvram block streaming is planned, not offered yet.)"}),
    "release_cache": (list(RELEASE), {"default": "never", "tooltip":
                      "after_run: release PyTorch's cached, unused VRAM blocks after each sampling run "
                      "(comfy.model_management.soft_empty_cache), so other programs and later stages get them. "
                      "never: keep them for reuse (faster next run)."}),
    "expandable_segments": ("BOOLEAN", {"default": False, "tooltip":
                            "Let the CUDA allocator grow segments instead of allocating new ones during sampling, "
                            "which cuts fragmentation (reserved much larger than allocated). Needs a torch build "
                            "with expandable segments (2.1+, Linux CUDA); on CPU or older torch the report says "
                            "it is off."}),
}


def _mm():
    import comfy.model_management as mm
    return mm


def activation_bytes(mm):
    """What ComfyUI itself keeps free for a step besides weights (its minimum inference memory without the
    user's extra reserve): 0.8 GiB on ComfyUI 0.3.x, 1 GiB on 2024 versions."""
    extra = mm.extra_reserved_memory() if hasattr(mm, "extra_reserved_memory") else 0
    return int(mm.minimum_inference_memory() - extra)


def diffusion_model(model):
    """The ModelPatcher's diffusion model (get_model_object on ComfyUI 0.3.x, the attribute on 2024)."""
    if hasattr(model, "get_model_object"):
        return model.get_model_object("diffusion_model")
    return model.model.diffusion_model


def budget_supported(mm, model):
    """None when the host can enforce a budget on this model, else why not."""
    if not hasattr(mm, "EXTRA_RESERVED_VRAM") or not hasattr(mm, "extra_reserved_memory"):
        return "this ComfyUI has no EXTRA_RESERVED_VRAM (update ComfyUI to 0.3.x)"
    if not hasattr(model, "add_wrapper_with_key"):
        return "this ComfyUI has no keyed sampler wrappers (update ComfyUI to 0.3.x)"
    return None


@contextlib.contextmanager
def budget_scope(mm, budget_bytes, total_bytes):
    """Raise EXTRA_RESERVED_VRAM so ComfyUI's loader sees at most `budget_bytes` of a card of `total_bytes`;
    restored on exit, whatever happens. Never lowers the user's own --reserve-vram."""
    old = mm.EXTRA_RESERVED_VRAM
    mm.EXTRA_RESERVED_VRAM = max(old, int(total_bytes) - int(budget_bytes))
    try:
        yield mm.EXTRA_RESERVED_VRAM
    finally:
        mm.EXTRA_RESERVED_VRAM = old


@contextlib.contextmanager
def expandable_segments_scope(device, notes):
    """Expandable segments for the CUDA allocator inside the scope, when the torch build can switch them."""
    setter = getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if device.type != "cuda":
        notes.append("expandable_segments: off (%s run)" % device.type)
        yield
        return
    if "expandable_segments:True" in conf:
        notes.append("expandable_segments: already on (PYTORCH_CUDA_ALLOC_CONF)")
        yield
        return
    if setter is None:
        notes.append("expandable_segments: off (this torch %s cannot switch it)" % torch.__version__)
        yield
        return
    try:
        setter("expandable_segments:True")
    except Exception as e:  # noqa: BLE001 - a build without the feature must not stop sampling
        notes.append("expandable_segments: off (%s)" % e)
        yield
        return
    notes.append("expandable_segments: on")
    try:
        yield
    finally:
        setter("expandable_segments:False")


def _unload_others(mm, patcher, device):
    keep = [lm for lm in mm.current_loaded_models if lm.model is patcher]
    mm.free_memory(1e30, device, keep_loaded=keep)


class PoolSettings:
    def __init__(self, budget_bytes, offload, release_cache, expandable_segments, plan):
        self.budget_bytes, self.offload, self.release_cache = budget_bytes, offload, release_cache
        self.expandable_segments, self.plan = expandable_segments, plan
        self.last_report, self.last_notes = None, []


def run_in_pool(settings, patcher, run, mm=None, total_bytes=None):
    """Runs `run()` (one sampling run of `patcher`) under the pool's settings; ComfyUI's globals are restored
    on return or error. Records a MemoryReport ("sampling") and notes on `settings`."""
    mm = mm or _mm()
    device = torch.device(patcher.load_device)
    notes, report = [], vram_report.MemoryReport()
    with contextlib.ExitStack() as stack:
        if settings.budget_bytes:
            if device.type == "cuda" or total_bytes is not None:
                total = total_bytes if total_bytes is not None else mm.get_total_memory(device)
                if settings.budget_bytes >= total:
                    notes.append("budget %.2f GiB >= the card's %.2f GiB: no cap" % (settings.budget_bytes / GIB,
                                                                                     total / GIB))
                else:
                    stack.enter_context(budget_scope(mm, settings.budget_bytes, total))
                    notes.append("budget %.2f GiB of %.2f GiB" % (settings.budget_bytes / GIB, total / GIB))
            else:
                notes.append("budget: not applied (the model runs on %s)" % device.type)
        if settings.expandable_segments:
            stack.enter_context(expandable_segments_scope(device, notes))
        if settings.offload == "medvram":
            if device.type == "cpu":
                notes.append("medvram: n/a (the model runs on cpu)")
            else:
                _unload_others(mm, patcher, device)
                notes.append("medvram: other models unloaded before, this one after")
        try:
            with report.stage("sampling", device):
                return run()
        finally:
            if settings.offload == "medvram" and device.type != "cpu":
                mm.free_memory(1e30, device)
            if settings.release_cache == "after_run":
                mm.soft_empty_cache()
                notes.append("cache released")
            settings.last_report, settings.last_notes = report.to_dict(), notes
            log.info("[SD Accel] VRAM Pool: %s | %s", report.summary(), "; ".join(notes) or "defaults")


def _outer_sample_wrapper(settings):
    def wrapper(executor, *args, **kwargs):
        patcher = executor.class_obj.model_patcher
        return run_in_pool(settings, patcher, lambda: executor(*args, **kwargs))
    wrapper.sd_accel_pool = settings
    return wrapper


class SDAccelVRAMPool:
    DESCRIPTION = ("Sets a VRAM budget and memory hygiene for the sampling runs of this model, through "
                   "ComfyUI's own memory manager. Active now: budget (checked before sampling; ComfyUI's loader "
                   "then sees only the budget and partially loads the model), medvram offload, cache release "
                   "after the run, expandable segments. Shows the residency plan: how many UNet blocks fit "
                   "on the GPU and the estimated peak. Planned (not offered yet): lowvram block streaming with "
                   "prefetch, automatic VAE tiling, retry with more offload on out-of-memory.")
    CATEGORY = "SD Accel/memory"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model on a clone that carries the pool's settings into every sampler using it.",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": dict(INPUTS)}

    def apply(self, model, budget_gib=0.0, offload="none", release_cache="never", expandable_segments=False):
        if offload not in OFFLOAD:
            raise ValueError("VRAM Pool: offload must be one of %s, got %r" % (", ".join(OFFLOAD), offload))
        if release_cache not in RELEASE:
            raise ValueError("VRAM Pool: release_cache must be one of %s, got %r" % (", ".join(RELEASE), release_cache))
        if budget_gib < 0:
            raise ValueError("VRAM Pool: budget_gib must be >= 0 (0 = no cap), got %r" % (budget_gib,))
        mm = _mm()
        budget = int(round(float(budget_gib) * GIB))
        sizes = vram_plan.unet_block_sizes(diffusion_model(model))
        try:
            plan = vram_plan.plan_residency(sizes, budget, activation_bytes(mm), PREFETCH_DEPTH)
        except vram_plan.BudgetTooSmall as e:
            raise ValueError("VRAM Pool: %s. Raise budget_gib to at least %.2f, or set it to 0 (no cap)."
                             % (e, e.needed / GIB)) from e
        settings = PoolSettings(budget, offload, release_cache, bool(expandable_segments), plan)
        clone = model.clone()
        unsupported = budget_supported(mm, clone)
        notes = []
        if unsupported is None:
            import comfy.patcher_extension as pe
            clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, _outer_sample_wrapper(settings))
        else:
            notes.append("NOT enforced: %s; the plan below is advisory" % unsupported)
            log.warning("[SD Accel] VRAM Pool settings not enforced: %s", unsupported)
        ui = plan.to_dict()
        ui.update(resident_count=len(plan.resident), streamed_count=len(plan.streamed), offload=offload,
                  release_cache=release_cache, expandable_segments=bool(expandable_segments),
                  enforced=unsupported is None, notes=notes)
        line = ("VRAM Pool: plan for block streaming: %s (placement now: ComfyUI's partial loading); offload %s, "
                "release cache %s, expandable segments %s%s") % (
            plan.summary(), offload, release_cache, "on" if expandable_segments else "off",
            " | " + "; ".join(notes) if notes else "")
        log.info("[SD Accel] %s", line)
        return {"ui": {"text": [line], "sdaccel_memory": [ui]}, "result": (clone,)}


NODE_CLASS_MAPPINGS = {"SDAccelVRAMPool": SDAccelVRAMPool}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelVRAMPool": "VRAM Pool (SD Accel)"}
