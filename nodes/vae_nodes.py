"""VAE Decode (SD Accel): decodes whole when it fits the memory budget, in planned tiles when it does not.

Stock ComfyUI tries a whole decode and falls back to fixed 512 px tiles only after an out-of-memory error;
under a VRAM budget (a small card, the VRAM Pool's budget, another program on the card) this node plans the
decode first (engine/memory/vae_plan.py) from ComfyUI's own estimate of the decode's memory and the VAE's weights,
and reports the stage's peak memory.
"""
import logging

import torch

from ..engine.memory import vae_plan
from ..engine.reports import vram_report

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


class SDAccelVAEDecode:
    DESCRIPTION = ("VAE Decode that plans for memory: decodes the whole image when ComfyUI's estimate of the "
                   "decode plus the VAE's weights fits the budget (or the GPU's free memory), and otherwise "
                   "decodes in the largest tiles that fit, instead of running out of memory first. Same inputs "
                   "and IMAGE output as VAE Decode; reports the choice and the decode's peak VRAM.")
    CATEGORY = "SD Accel/memory"
    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The decoded image, as VAE Decode gives it.",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "samples": ("LATENT", {"tooltip": "The latent to decode."}),
            "vae": ("VAE", {"tooltip": "The VAE, as for VAE Decode."}),
            "budget_gib": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.25, "tooltip":
                           "Memory the decode may use, VAE weights included, in GiB. 0: the GPU's free memory "
                           "at decode time. Tiled decoding is chosen when the whole decode would not fit; "
                           "tiles can show faint seams, as with VAE Decode (Tiled)."}),
        }, "optional": {   # optional, so workflows saved before it existed still load
            "release_cache": (["after_decode", "never"], {"default": "after_decode", "tooltip":
                              "after_decode: give the allocator's cached blocks back to the GPU once the image "
                              "is decoded (the decode's working memory, GiBs at 1024 px, otherwise stays "
                              "reserved by this process until the next cleanup). never: keep them cached, as "
                              "VAE Decode does."}),
        }}

    def decode(self, samples, vae, budget_gib=0.0, release_cache="after_decode"):
        if budget_gib < 0:
            raise ValueError("VAE Decode (SD Accel): budget_gib must be >= 0 (0 = the GPU's free memory)")
        mm = _mm()
        lat = samples["samples"]
        report, notes = vram_report.MemoryReport(), []
        plan = None
        if lat.dim() != 4 or not isinstance(getattr(vae, "downscale_ratio", 8), int):
            notes.append("not a 2-D image latent: decoded whole by ComfyUI")
        else:
            budget, why = decode_budget(mm, vae, budget_gib)
            if budget is None:
                notes.append(why)
            else:
                h, w = lat.shape[-2:]
                per_px = vae.memory_used_decode((1,) + tuple(lat.shape[1:]), vae.vae_dtype) / float(h * w)
                try:
                    plan = vae_plan.plan_decode(h, w, per_px, vae.patcher.model_size(), budget)
                except vae_plan.DecodeTooLarge as e:
                    raise ValueError("VAE Decode (SD Accel): %s (%s). Raise budget_gib, or free the GPU."
                                     % (e, why)) from e
                notes.append(why)
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
        return {"ui": {"text": [line], "sdaccel_memory": [ui]}, "result": (images,)}


NODE_CLASS_MAPPINGS = {"SDAccelVAEDecode": SDAccelVAEDecode}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelVAEDecode": "VAE Decode (SD Accel)"}
