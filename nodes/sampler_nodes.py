"""Accelerated KSampler and Apply SD Accel: thin ComfyUI nodes over hosts/comfyui/accelerate.py."""
import importlib
import logging

from ..hosts.comfyui import accelerate as host
from ..hosts.comfyui import run as host_run

log = logging.getLogger("sd_accel")

ACCEL_INPUTS = {
    "fused_kernels": ("BOOLEAN", {"default": True, "tooltip":
                      "Swap GroupNorm(+SiLU), LayerNorm and GEGLU for fused Triton kernels, and fold the "
                      "ResBlocks' biases, timestep embedding and residual adds and the transformer blocks' "
                      "residual adds into them. Lossless (fp32 statistics). Falls back to the stock op, with one "
                      "log line, where a kernel cannot run (CPU, no Triton, GPU older than sm_70, odd shapes)."}),
    "cuda_graph": ("BOOLEAN", {"default": True, "tooltip":
                   "Replay each denoising step from a CUDA graph: removes Python and launch overhead. One "
                   "capture per shape; recaptured when a LoRA, weight patch, resolution or batch changes. "
                   "Off automatically on CPU and while weights are offloaded."}),
    "channels_last": ("BOOLEAN", {"default": True, "tooltip":
                      "Run the CUDA graphs' convolutions in channels_last (NHWC), so cuDNN needs no layout "
                      "transform around each one. The loaded UNet's conv weights are converted in place before "
                      "its first capture (values unchanged), as ComfyUI's --force-channels-last does; steps that "
                      "run without graphs keep stock's layout, where stock's modules are fastest. GPU only."}),
}
CONTROLNET_INPUTS = {
    "controlnet": ("BOOLEAN", {"default": True, "tooltip":
                   "Also accelerate the ControlNets attached to positive/negative (Apply ControlNet) with the "
                   "options above: fused kernels, channels_last, and with cuda_graph the ControlNets run inside "
                   "the UNet's CUDA graph, one replay per step (start/end percent decided every step; a new "
                   "hint, strength or ControlNet never replays a stale graph); "
                   "without CUDA graphs its input hint block is computed once per run instead of at every step. "
                   "Lossless. Works on a patched copy: the loaded ControlNet and other samplers are untouched. "
                   "Full ControlNets only; T2I adapters and control-LoRAs run stock."}),
    "controlnet_cond_only": ("BOOLEAN", {"default": False, "tooltip":
                             "LOSSY, off by default: the image changes. Runs the ControlNets on the positive "
                             "(cond) rows of each batch only; the negative (uncond) rows get no ControlNet "
                             "residual. Saves about half of the ControlNets' work per step with CFG (they "
                             "normally run on positive and negative together). Needs a ComfyUI that tells the "
                             "ControlNet which rows are cond (current ComfyUI does); an older one runs the full "
                             "batch, lossless, and the report says so."}),
}


ATTENTION_INPUTS = {
    "attention": (list(host.ATTENTION_BACKENDS), {"default": "auto", "tooltip":
                  "Attention backend per call: auto keeps ComfyUI's own choice; sdpa = PyTorch SDPA; "
                  "xformers and sage (SageAttention) when installed. A call a backend cannot run (CPU, "
                  "SD1.5's head dims 40/80/160 for sage) uses SDPA and the report says why."}),
}
STEP_CACHE_INPUTS = {
    "step_cache": (list(host.STEP_CACHE_MODES), {"default": "off", "tooltip":
                   "LOSSY, off by default: the image changes. DeepCache: on a full step the whole UNet runs and "
                   "its deep features are kept; on the steps between, only the shallow blocks (input blocks up "
                   "to the skip branch and the output blocks from it) run, on the kept features. 'interval N': "
                   "every Nth step full (0, N, 2N, ...); 'non-uniform N': as many full steps, denser early in the "
                   "run. ControlNet residuals and patches of the skipped blocks are skipped with them. Needs "
                   "current ComfyUI and an SD1.5/SDXL-style UNet; elsewhere the whole UNet runs every step and "
                   "the report says why. The report says how many steps ran cached."}),
    "step_cache_branch": ("INT", {"default": 0, "min": 0, "max": 11, "tooltip":
                          "LOSSY with step_cache on (ignored when off): the skip branch, the last input block that "
                          "still runs on cached steps (0 = only the first convolution and the last output block). "
                          "Higher runs more blocks per cached step: slower, closer to the full image."}),
}


PRECISION_INPUTS = {
    "precision": (["fp16", "fp8"], {"default": "fp16", "tooltip":
                  "LOSSY with fp8, which is off by default: the image changes slightly. fp8 runs each transformer block's "
                  "feed-forward GEGLU projection (its widest matrix multiply) in FP8 e4m3 on the tensor cores, "
                  "with per-channel weight and per-token activation scales and the GEGLU fused into the multiply; "
                  "everything else stays fp16. A few percent faster on Ada and Hopper GPUs (sm_89/sm_90), most "
                  "at SDXL sizes; elsewhere the model runs fp16 and the report says why. Weights are quantized "
                  "once per load and again after every LoRA or weight change."}),
    "fp8_weights": (list(host.FP8_WEIGHTS), {"default": "fp16 copies", "tooltip":
                    "Lossless either way; only for checkpoints stored in fp8 (UNETLoader weight_dtype fp8_e4m3fn, "
                    "fp8 checkpoints), ignored for fp16 ones. 'fp16 copies': one fp16 copy of each weight where the "
                    "GPU has room, so no step casts weights (fastest; the UNet's weights then take three times the "
                    "VRAM of the fp8 ones). 'as stored' (and where the copies do not fit): the weights stay fp8 and "
                    "each step casts them a group of layers at a time, one kernel a group (the UNet's weights in half "
                    "the VRAM of an fp16 model, plus one or two groups' fp16 copies while a step runs; slower). "
                    "Copies made "
                    "earlier for the same loaded model are freed when ComfyUI unloads it."}),
}


def _comfy_nodes():
    # ComfyUI's own top-level nodes.py (never our package's nodes/: we import relatively)
    return importlib.import_module("nodes")


def _options(fused_kernels, cuda_graph, channels_last, attention="auto", step_cache="off", step_cache_branch=0,
             precision="fp16", fp8_weights="fp16 copies"):
    return host.AccelOptions(bool(fused_kernels), bool(cuda_graph), bool(channels_last), attention,
                             step_cache=step_cache, step_cache_branch=int(step_cache_branch), precision=precision,
                             fp8_weights=fp8_weights)


class SDAccelKSampler:
    DESCRIPTION = ("KSampler with SD Accel's lossless accelerations: fused kernels, CUDA-graph replay and "
                   "channels_last convolutions, on the model and on the ControlNets in the conditioning. Same "
                   "inputs and the same LATENT output as KSampler; with every option off it is exactly "
                   "KSampler. Opt-in lossy options (LOSSY in their tooltips): controlnet_cond_only, step_cache and "
                   "precision fp8. "
                   "Reports it/s, seconds, peak VRAM "
                   "and what ran or fell back (and why) after each run.")
    CATEGORY = "SD Accel/sampling"
    RETURN_TYPES = ("LATENT", "STRING")
    RETURN_NAMES = ("LATENT", "report")
    OUTPUT_TOOLTIPS = ("The denoised latent, as KSampler gives it.",
                       "One line: it/s, seconds, peak VRAM, what ran and what fell back.")
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        base = _comfy_nodes().KSampler.INPUT_TYPES()
        req = dict(base["required"])
        req.update(ACCEL_INPUTS)
        # optional, so prompts and workflows saved before it existed still load
        return {"required": req, "optional": {**ATTENTION_INPUTS, **CONTROLNET_INPUTS, **STEP_CACHE_INPUTS,
                                               **PRECISION_INPUTS}}

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
               denoise=1.0, fused_kernels=True, cuda_graph=True, channels_last=True, controlnet=True, attention="auto",
               controlnet_cond_only=False, step_cache="off", step_cache_branch=0, precision="fp16",
               fp8_weights="fp16 copies"):
        common_ksampler = _comfy_nodes().common_ksampler
        opts = _options(fused_kernels, cuda_graph, channels_last, attention, step_cache, step_cache_branch, precision,
                        fp8_weights)
        run = host_run.prepare(model, positive, negative, opts, controlnet=controlnet, cond_only=controlnet_cond_only)
        out = run.sample(lambda m, pos, neg: common_ksampler(m, seed, steps, cfg, sampler_name, scheduler, pos, neg,
                                                             latent_image, denoise=denoise))
        report, line = run.report(steps)
        log.info("[SD Accel] %s", line)
        return {"ui": {"sdaccel_report": [report], "text": [line]}, "result": (out[0], line)}


class SDAccelApply:
    DESCRIPTION = ("Applies SD Accel to a MODEL for graphs that use other samplers (KSamplerAdvanced, "
                   "SamplerCustom, ...). The input model is untouched: the output is a patched clone, the "
                   "ComfyUI way, so removing this node restores stock behaviour. ControlNets are not reached "
                   "from here (they travel in the conditioning): Accelerated KSampler accelerates those. Opt-in "
                   "lossy options: step_cache and precision fp8.")
    CATEGORY = "SD Accel/patches"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model with SD Accel's patches on a clone.",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        req = {"model": ("MODEL", {"tooltip": "The model to accelerate (a UNet: SD1.5, SDXL and relatives)."})}
        req.update(ACCEL_INPUTS)
        return {"required": req, "optional": {**ATTENTION_INPUTS, **STEP_CACHE_INPUTS, **PRECISION_INPUTS}}

    def apply(self, model, fused_kernels=True, cuda_graph=True, channels_last=True, attention="auto",
              step_cache="off", step_cache_branch=0, precision="fp16", fp8_weights="fp16 copies"):
        opts = _options(fused_kernels, cuda_graph, channels_last, attention, step_cache, step_cache_branch, precision,
                        fp8_weights)
        patched, info = host.accelerate(model, opts)
        parts = ["%s x%d" % kv for kv in sorted(info.get("patched", {}).items())]
        line = "patched: %s; step wrapper: %s" % (", ".join(parts) or "nothing", info.get("wrapper") or "none")
        if info.get("reasons", {}).get(host.WHOLE_MODEL):
            line += "; " + info["reasons"][host.WHOLE_MODEL]
        if step_cache != "off":
            why = info.get("reasons", {}).get("step_cache")
            line += "; step_cache %s: %s" % (step_cache, "refused: " + why if why else
                                              "LOSSY, branch %d (each run's count in the log)" % opts.step_cache_branch)
        if info.get("reasons", {}).get("precision fp8"):
            line += "; precision fp8 (LOSSY) not used: " + info["reasons"]["precision fp8"]
        log.info("[SD Accel] Apply: %s", line)
        return {"ui": {"text": [line]}, "result": (patched,)}


NODE_CLASS_MAPPINGS = {"SDAccelKSampler": SDAccelKSampler, "SDAccelApply": SDAccelApply}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelKSampler": "Accelerated KSampler (SD Accel)",
                              "SDAccelApply": "Apply SD Accel"}
