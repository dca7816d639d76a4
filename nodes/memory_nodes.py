"""VRAM Pool node: a VRAM budget and memory hygiene for the sampling runs of one model. A thin node over
hosts/comfyui/memory.py, which says what each setting does and how it goes through ComfyUI's model_management,
and hosts/comfyui/clip_stage.py for its clip output."""
from ..hosts.comfyui import clip_stage, memory as host
from ..hosts.comfyui.memory import OFFLOAD, RELEASE

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
                "unloaded so the VAE decode has the card. lowvram: ComfyUI loads what fits in the budget and "
                "the rest of the UNet is streamed to the GPU unit by unit (a ResBlock, a transformer block) "
                "from pinned RAM, the next unit copied while the current one computes (CUDA and ComfyUI "
                "0.3.x; elsewhere it runs as none and the report says so). With medvram or lowvram, this "
                "model and the models loaded beside it (text encoder, VAE) keep a pinned copy of their "
                "weights in system RAM while on the GPU, so moving them off copies nothing and moving them "
                "back is faster. Same image as without offload."}),
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


class SDAccelVRAMPool:
    DESCRIPTION = ("Sets a VRAM budget and memory hygiene for the sampling runs of this model, through "
                   "ComfyUI's own memory manager: budget (checked before sampling; ComfyUI's loader then sees "
                   "only the budget and partially loads the model), offload medvram or lowvram (the UNet units "
                   "that do not fit are streamed to the GPU with the next one prefetched), cache release after "
                   "the run, expandable segments. An out-of-memory during sampling is retried once with more "
                   "offload. With a CLIP on its clip input, the text encode through its clip output runs under "
                   "the same budget. Shows the residency plan: how many UNet units (ResBlocks, transformer "
                   "blocks...) fit on the GPU and the estimated peak; after each run the Accelerated KSampler's "
                   "report gives the pool's measurement per stage (text encode, sampling: peak allocated, "
                   "reserved, fragmentation). For the decode under a budget, use VAE Decode (SD Accel): it tiles "
                   "when the whole decode would not fit, and reports its own stage.")
    CATEGORY = "SD Accel/memory"
    RETURN_TYPES = ("MODEL", "CLIP")
    RETURN_NAMES = ("model", "clip")
    OUTPUT_TOOLTIPS = ("The same model on a clone that carries the pool's settings into every sampler using it.",
                       "The CLIP given to the clip input, on a clone whose text encodes run under the budget and "
                       "are measured as the pool's 'text encode' stage. Connect it straight to the text encoders "
                       "(a LoRA loader after it would give a CLIP without the pool).")
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        # optional, so prompts and workflows saved before it existed still load
        return {"required": dict(INPUTS), "optional": {"clip": ("CLIP", {"tooltip":
                "Optional: the checkpoint's CLIP, to run the text encode under the same budget and report its "
                "memory with the sampling run's (in the Accelerated KSampler's report)."})}}

    def apply(self, model, budget_gib=0.0, offload="none", release_cache="never", expandable_segments=False,
              clip=None):
        if offload not in OFFLOAD:
            raise ValueError("VRAM Pool: offload must be one of %s, got %r" % (", ".join(OFFLOAD), offload))
        if release_cache not in RELEASE:
            raise ValueError("VRAM Pool: release_cache must be one of %s, got %r" % (", ".join(RELEASE), release_cache))
        if budget_gib < 0:
            raise ValueError("VRAM Pool: budget_gib must be >= 0 (0 = no cap), got %r" % (budget_gib,))
        clone, line, ui = host.make_pool(model, budget_gib, offload, release_cache, expandable_segments)
        settings = host.pool_settings(clone)
        if clip is None:
            clip_out = clip_stage.NoClip()
        elif settings is None:          # a ComfyUI without keyed wrappers: no pool to report to
            clip_out = clip
            line += " | clip: passed through (this ComfyUI cannot apply the pool)"
        else:
            clip_out = clip_stage.pool_clip(clip, settings)
            line += " | clip: text encode under the pool"
        ui["clip"] = clip is not None
        return {"ui": {"text": [line], "sdaccel_memory": [ui]}, "result": (clone, clip_out)}


NODE_CLASS_MAPPINGS = {"SDAccelVRAMPool": SDAccelVRAMPool}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelVRAMPool": "VRAM Pool (SD Accel)"}
