"""Accelerated KSampler and Apply SD Accel: thin ComfyUI nodes over hosts/comfyui.py."""
import importlib
import logging
import os

from ..engine import attention, kernel_report, run_report, vram_report
from ..hosts import comfyui as host
from ..hosts import comfyui_controlnet as host_cn
from ..hosts import comfyui_memory as host_memory

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
                      "Run convolutions in channels_last (NHWC), so cuDNN needs no layout transform around "
                      "each one. Converts the loaded UNet's conv weights in place (values unchanged), as "
                      "ComfyUI's --force-channels-last does. GPU only."}),
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
    "attention": (list(attention.BACKENDS), {"default": "auto", "tooltip":
                  "Attention backend per call: auto keeps ComfyUI's own choice; sdpa = PyTorch SDPA; "
                  "xformers and sage (SageAttention) when installed. A call a backend cannot run (CPU, "
                  "SD1.5's head dims 40/80/160 for sage) uses SDPA and the report says why."}),
}


def _comfy_nodes():
    # ComfyUI's own top-level nodes.py (never our package's nodes/: we import relatively)
    return importlib.import_module("nodes")


def _options(fused_kernels, cuda_graph, channels_last, attention="auto"):
    return host.AccelOptions(bool(fused_kernels), bool(cuda_graph), bool(channels_last), attention)


def _is_interrupt(e):
    try:
        import comfy.model_management as mm
        return isinstance(e, mm.InterruptProcessingException)
    except Exception:  # noqa: BLE001
        return False


class SDAccelKSampler:
    DESCRIPTION = ("KSampler with SD Accel's lossless accelerations: fused kernels, CUDA-graph replay and "
                   "channels_last convolutions, on the model and on the ControlNets in the conditioning. Same "
                   "inputs and the same LATENT output as KSampler; with every option off it is exactly "
                   "KSampler. One opt-in lossy option: controlnet_cond_only. Reports it/s, seconds, peak VRAM "
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
        return {"required": req, "optional": {**ATTENTION_INPUTS, **CONTROLNET_INPUTS}}

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
               denoise=1.0, fused_kernels=True, cuda_graph=True, channels_last=True, controlnet=True, attention="auto",
               controlnet_cond_only=False):
        comfy_nodes = _comfy_nodes()
        opts = _options(fused_kernels, cuda_graph, channels_last, attention)
        notes = []
        if opts.any():
            patched, info = host.accelerate(model, opts)
        else:
            patched, info = model, {"options": opts.__dict__.copy()}
        cn_info = None
        cn_pos, cn_neg = positive, negative
        if controlnet or controlnet_cond_only:
            cn_pos, cn_neg, cn_info = host_cn.accelerate_conds(
                positive, negative, host_cn.ControlNetOptions(
                    fused_kernels=bool(controlnet) and opts.fused_kernels, hint_cache=bool(controlnet),
                    cuda_graph=bool(controlnet) and opts.cuda_graph,
                    channels_last=bool(controlnet) and opts.channels_last, cond_only=bool(controlnet_cond_only),
                    one_graph=bool(controlnet) and not controlnet_cond_only and host.runs_controlnets_in_graph(
                        patched, info)))
        host.new_sampling_run(info)
        k0, g0, cg0 = kernel_report.snapshot(), host.graph_stats(info), host_cn.graph_stats(cn_info)
        c0 = run_report.compile_snapshot()
        try:
            with run_report.RunTimer() as timer:
                out = comfy_nodes.common_ksampler(patched, seed, steps, cfg, sampler_name, scheduler, cn_pos,
                                                  cn_neg, latent_image, denoise=denoise)
        except Exception as e:  # noqa: BLE001 - never lose the user's run to an acceleration fault
            accelerated = patched is not model or bool(cn_info and cn_info["controlnets"])
            if not accelerated or _is_interrupt(e) or os.environ.get("SDACCEL_STRICT") == "1":
                raise   # SDACCEL_STRICT=1 (tests, benchmarks): an acceleration fault must be seen
            log.error("[SD Accel] accelerated sampling failed (%s: %s); running the stock KSampler instead",
                      type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
            notes.append("accelerated run failed (%s), result from the stock path" % type(e).__name__)
            st = info.get("graph_state")
            if st is not None:
                st.graphs.clear("error during an accelerated run")
            with run_report.RunTimer() as timer:
                out = comfy_nodes.common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive,
                                                  negative, latent_image, denoise=denoise)
            host_cn.release(cn_info)
            info, cn_info = {"options": {}}, None
        finally:
            if cn_info:
                cg1 = host_cn.graph_stats(cn_info)
                cn_info["graph_delta"] = {k: cg1[k] - cg0.get(k, 0) for k in cg1}
            cn_line = host_cn.summary(cn_info)
            host_cn.release(cn_info)
        if cn_line:
            notes.append(cn_line)
        compiled = run_report.compile_note(c0, run_report.compile_snapshot())
        if compiled:
            notes.append(compiled)
        g1 = host.graph_stats(info)
        graphs = {k: g1[k] - g0.get(k, 0) for k in g1} if g1 else {}
        st = info.get("graph_state")
        if graphs and st is not None and not graphs.get("replays"):
            graphs["eager_reason"] = st.graphs.last_eager_reason
        pool = host_memory.pool_settings(model)
        if pool is not None and pool.last_report is not None:
            # the VRAM Pool's own measurement of this run (and of its text encode): shown with the run's report
            notes.append("VRAM Pool: %s%s" % (vram_report.summary_of(pool.last_report),
                                              " | " + "; ".join(pool.last_notes) if pool.last_notes else ""))
        report = run_report.build(steps, timer, kernel_report.summarize(k0, kernel_report.snapshot()),
                                  graphs, info.get("options", {}), notes)
        if pool is not None and pool.last_report is not None:
            report["memory"] = pool.last_report
        line = run_report.one_line(report) + (" | " + cn_line if cn_line else "")
        log.info("[SD Accel] %s", line)
        return {"ui": {"sdaccel_report": [report], "text": [line]}, "result": (out[0], line)}


class SDAccelApply:
    DESCRIPTION = ("Applies SD Accel to a MODEL for graphs that use other samplers (KSamplerAdvanced, "
                   "SamplerCustom, ...). The input model is untouched: the output is a patched clone, the "
                   "ComfyUI way, so removing this node restores stock behaviour. ControlNets are not reached "
                   "from here (they travel in the conditioning): Accelerated KSampler accelerates those.")
    CATEGORY = "SD Accel/patches"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model with SD Accel's patches on a clone.",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        req = {"model": ("MODEL", {"tooltip": "The model to accelerate (a UNet: SD1.5, SDXL and relatives)."})}
        req.update(ACCEL_INPUTS)
        return {"required": req, "optional": dict(ATTENTION_INPUTS)}

    def apply(self, model, fused_kernels=True, cuda_graph=True, channels_last=True, attention="auto"):
        opts = _options(fused_kernels, cuda_graph, channels_last, attention)
        patched, info = host.accelerate(model, opts)
        parts = ["%s x%d" % kv for kv in sorted(info.get("patched", {}).items())]
        line = "patched: %s; step wrapper: %s" % (", ".join(parts) or "nothing", info.get("wrapper") or "none")
        log.info("[SD Accel] Apply: %s", line)
        return {"ui": {"text": [line]}, "result": (patched,)}


NODE_CLASS_MAPPINGS = {"SDAccelKSampler": SDAccelKSampler, "SDAccelApply": SDAccelApply}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelKSampler": "Accelerated KSampler (SD Accel)",
                              "SDAccelApply": "Apply SD Accel"}
