"""ComfyUI host, memory side: what the VRAM Pool reads from and sets on ComfyUI's model_management around one
run: what a step needs besides weights, the budget its loader sees, expandable segments, pinned host copies
of the loaded models, and medvram's unloading of the others. Each setting is restored when its scope ends."""
import contextlib
import os

import torch

from ...engine.memory import host_mirror
from ...engine.memory.vram_plan import GIB


def model_management():
    import comfy.model_management as mm
    return mm


def activation_bytes(mm):
    """What ComfyUI itself keeps free for a step besides weights (its minimum inference memory without the
    user's extra reserve): 0.8 GiB on ComfyUI 0.3.x, 1 GiB on 2024 versions."""
    extra = mm.extra_reserved_memory() if hasattr(mm, "extra_reserved_memory") else 0
    return int(mm.minimum_inference_memory() - extra)


def activation_estimate(mm, model):
    """The planner's activation bytes: ComfyUI's own estimate for this model (BaseModel.memory_required) at its
    native size (latent 64², SDXL-type models 128²), CFG batch 2, capped at ComfyUI's minimum inference
    reserve (the estimate without flash/xformers attention, e.g. on CPU, is far above it)."""
    reserve = activation_bytes(mm)
    try:
        bm = model.model
        lat = 128 if bm.model_config.unet_config.get("adm_in_channels") else 64
        return int(min(reserve, bm.memory_required([2, 4, lat, lat])))
    except Exception:  # noqa: BLE001 - an unusual model class: ComfyUI's reserve
        return reserve


def diffusion_model(model):
    """The ModelPatcher's diffusion model (get_model_object on ComfyUI 0.3.x, the attribute on 2024)."""
    if hasattr(model, "get_model_object"):
        return model.get_model_object("diffusion_model")
    return model.model.diffusion_model


def budget_supported(mm, model=None):
    """None when the host can enforce a budget on this model (any model: None), else why not."""
    if not hasattr(mm, "EXTRA_RESERVED_VRAM") or not hasattr(mm, "extra_reserved_memory"):
        return "this ComfyUI has no EXTRA_RESERVED_VRAM (update ComfyUI to 0.3.x)"
    if model is None:
        return None
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


def mirror_models(mm, patcher, device):
    """Arms the host mirror on the pooled model and on every model ComfyUI has loaded on `device` (the ones
    that take turns with it in the budget). Returns a note."""
    if device.type != "cuda":
        return "host copies: off (the model runs on %s)" % device.type
    host_mirror.release_freed()
    modules = [getattr(patcher, "model", None)]
    for lm in mm.current_loaded_models:
        if getattr(lm, "device", None) == device:
            modules.append(getattr(getattr(lm, "model", None), "model", None))
    modules = list({id(m): m for m in modules if isinstance(m, torch.nn.Module)}.values())
    mirrors = [host_mirror.arm(m) for m in modules]
    held = sum(m.host_bytes() for m in mirrors)
    reused = sum(m.stats["reused_bytes"] for m in mirrors)
    return "host copies: %d models mirrored (%.2f GiB held; %.2f GiB of moves off the GPU so far without a copy)" % (
        len(mirrors), held / GIB, reused / GIB)


def unload_others(mm, patcher, device):
    """medvram: every model but `patcher`'s off `device`, before its sampling run."""
    keep = [lm for lm in mm.current_loaded_models if lm.model is patcher]
    mm.free_memory(1e30, device, keep_loaded=keep)
