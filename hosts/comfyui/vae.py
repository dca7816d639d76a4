"""ComfyUI host, VAE side: the VAE Decode (SD Accel) and VAE Encode (SD Accel) nodes' work.

Stock ComfyUI tries a whole decode and falls back to fixed 512 px tiles only after an out-of-memory error;
under a VRAM budget (a small card, the VRAM Pool's budget, another program on the card) the decode is planned
first (engine/memory/vae_plan.py) from ComfyUI's own estimate of the decode's memory and the VAE's weights,
and the stage's peak memory is reported. Both nodes run on the VAE's accelerated copy (hosts/comfyui/vae_accel.py:
fused kernels, channels_last, CUDA graphs) and report what ran and what fell back; under an explicit budget
no graph is kept (its memory would stay reserved past the decode).
"""
import contextlib
import logging

import torch

from ...engine.graphs import eager
from ...engine.memory import vae_plan
from ...engine.reports import vram_report
from . import vae_accel

log = logging.getLogger("sd_accel")
GIB = 2 ** 30


def _mm():
    import comfy.model_management as mm
    return mm


def _vae_loaded(mm, vae):
    return any(lm.model is vae.patcher for lm in getattr(mm, "current_loaded_models", ()))


def decode_budget(mm, vae, budget_gib):
    """(bytes the decode may use, why). budget_gib > 0: that. Else, on a GPU: its free memory now plus the
    VAE's weights if they are already there. On the CPU: None (no VRAM to plan for)."""
    weights = vae.patcher.model_size()
    if budget_gib and budget_gib > 0:
        return int(budget_gib * GIB), "budget %.2f GiB" % budget_gib
    device = torch.device(vae.device)
    if device.type != "cuda":
        return None, "decoding on %s: no VRAM budget" % device.type
    free = mm.get_free_memory(device)
    return int(free + (weights if _vae_loaded(mm, vae) else 0)), "free VRAM %.2f GiB" % (free / GIB)


def _plan(mm, vae, lat, budget_gib, notes):
    """The decode plan for this latent and budget (None: ComfyUI decodes whole), its reason in `notes`."""
    if lat.dim() != 4 or not isinstance(getattr(vae, "downscale_ratio", 8), int):
        notes.append("not a 2-D image latent: decoded whole by ComfyUI")
        return None
    budget, why = decode_budget(mm, vae, budget_gib)
    notes.append(why)
    if budget is None:
        return None
    h, w = lat.shape[-2:]
    per_px = vae.memory_used_decode((1,) + tuple(lat.shape[1:]), vae.vae_dtype) / float(h * w)
    try:
        return vae_plan.plan_decode(h, w, per_px, vae.patcher.model_size(), budget)
    except vae_plan.DecodeTooLarge as e:
        raise ValueError("VAE Decode (SD Accel): %s (%s). Raise budget_gib, or free the GPU." % (e, why)) from e


def decode(vae, samples, budget_gib=0.0, release_cache="after_decode", options=vae_accel.VAEOptions()):
    """(images, one-line report, ui dict) of a planned decode, on the VAE's accelerated copy."""
    if budget_gib < 0:
        raise ValueError("VAE Decode (SD Accel): budget_gib must be >= 0 (0 = the GPU's free memory)")
    mm = _mm()
    lat = samples["samples"]
    report, notes, accel = vram_report.MemoryReport(), [], {}
    plan = _plan(mm, vae, lat, budget_gib, notes)
    acc, info = vae_accel.accelerate_vae(vae, options)
    with report.stage("VAE decode", getattr(vae, "device", None)), _budget_scope(budget_gib), \
            vae_accel.measured(info, accel):
        if plan is not None and plan.mode == "tiled":
            images = acc.decode_tiled(lat, tile_x=plan.tile, tile_y=plan.tile, overlap=plan.overlap)
        else:
            images = acc.decode(lat)
    if images.dim() == 5:   # video VAEs: frames into the batch, as VAE Decode does
        images = images.reshape(-1, *images.shape[-3:])
    if release_cache == "after_decode":
        mm.soft_empty_cache()
        notes.append("cache released")
    line = "%s | %s | %s%s" % (plan.summary() if plan else "VAE decode whole", report.summary(), accel["line"],
                               " | " + "; ".join(notes) if notes else "")
    log.info("[SD Accel] %s", line)
    ui = {"mode": plan.mode if plan else "whole", "tile_px": plan.tile * 8 if plan else 0,
          "memory": report.to_dict(), "notes": notes, "accel": accel}
    return images, line, ui


def _budget_scope(budget_gib):
    """An explicit budget: nothing may stay allocated past the decode (no graph memory), nothing allocated beyond
    the plan (no cuDNN autotuning, no compiling ahead)."""
    return eager.under_vram_budget() if budget_gib and budget_gib > 0 else contextlib.nullcontext()


def encode(vae, pixels, options=vae_accel.VAEOptions()):
    """(latent dict, one-line report, ui dict): VAE Encode's work (the image's first three channels) on the
    VAE's accelerated copy."""
    report, accel = vram_report.MemoryReport(), {}
    acc, info = vae_accel.accelerate_vae(vae, options)
    with report.stage("VAE encode", getattr(vae, "device", None)), vae_accel.measured(info, accel):
        latent = acc.encode(pixels[:, :, :, :3])
    line = "VAE encode | %s | %s" % (report.summary(), accel["line"])
    log.info("[SD Accel] %s", line)
    return {"samples": latent}, line, {"memory": report.to_dict(), "accel": accel}
