"""ComfyUI host, VAE side: a VAE decode planned for memory (the VAE Decode (SD Accel) node's work).

Stock ComfyUI tries a whole decode and falls back to fixed 512 px tiles only after an out-of-memory error;
under a VRAM budget (a small card, the VRAM Pool's budget, another program on the card) the decode is planned
first (engine/memory/vae_plan.py) from ComfyUI's own estimate of the decode's memory and the VAE's weights,
and the stage's peak memory is reported.
"""
import logging

import torch

from ...engine.memory import vae_plan
from ...engine.reports import vram_report

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


def decode(vae, samples, budget_gib=0.0, release_cache="after_decode"):
    """(images, one-line report, ui dict) of a planned decode."""
    if budget_gib < 0:
        raise ValueError("VAE Decode (SD Accel): budget_gib must be >= 0 (0 = the GPU's free memory)")
    mm = _mm()
    lat = samples["samples"]
    report, notes = vram_report.MemoryReport(), []
    plan = _plan(mm, vae, lat, budget_gib, notes)
    with report.stage("VAE decode", getattr(vae, "device", None)):
        if plan is not None and plan.mode == "tiled":
            images = vae.decode_tiled(lat, tile_x=plan.tile, tile_y=plan.tile, overlap=plan.overlap)
        else:
            images = vae.decode(lat)
    if images.dim() == 5:   # video VAEs: frames into the batch, as VAE Decode does
        images = images.reshape(-1, *images.shape[-3:])
    if release_cache == "after_decode":
        mm.soft_empty_cache()
        notes.append("cache released")
    line = "%s | %s%s" % (plan.summary() if plan else "VAE decode whole", report.summary(),
                          " | " + "; ".join(notes) if notes else "")
    log.info("[SD Accel] %s", line)
    ui = {"mode": plan.mode if plan else "whole", "tile_px": plan.tile * 8 if plan else 0,
          "memory": report.to_dict(), "notes": notes}
    return images, line, ui
