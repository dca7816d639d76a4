"""ComfyUI host, text encoders: each CLIP text encoder's layers replayed from a CUDA graph, on a copy of a CLIP.

A prompt's encode is little GPU work (77 tokens through 12 or 32 layers) issued by a lot of Python: ComfyUI's
text encoders run every Linear through its manual cast, in fp32, and an SDXL CLIP has 44 layers of them. Once
the UNet's steps replay from graphs, that host time is a visible part of a user's wait for an image.

ComfyUI's CLIP (comfy.sd.CLIP, 2024 and current) holds its text encoders, `cond_stage_model` (SD1.5: `clip_l`;
SDXL: `clip_l` and `clip_g`; SD2: `clip_h`), in a ModelPatcher (`clip.patcher`). Each is an SDClipModel whose
`transformer.text_model.encoder` (comfy.clip_model.CLIPEncoder) runs the layers, called as
`encoder(x, mask=..., intermediate_output=...)`. `accelerate_clip(clip)` returns `clip.clone()` (ComfyUI's own
copy: a clone of its patcher, the same encoders) with one object patch per encoder,
`<encoder>.transformer.text_model.encoder.forward` -> GraphedForward (engine/graphs/graphed_forward.py): a graph
per batch of 77-token chunks (a long or weighted prompt has more) and per output layer (CLIP Set Last Layer).
The token embeddings (textual inversions' among them), the masks, the final LayerNorm, the pooled output and its
projection stay in ComfyUI's code, and so does everything around them (tokenizers, prompt weights, hooks). The
layers are ComfyUI's own modules: a replay runs the kernels an eager call runs, so the conditioning is stock's.
StepGraphs keys and guards each call as it does a UNet step: weights not all on the GPU (a partially loaded
text encoder), a LoRA or hook patch that replaces a weight, a key the probe finds uncapturable: eager, and the
graphs never replay stale weights. Calls with weight functions (ComfyUI's low-VRAM LoRA patches, applied by
Python on every call) run eagerly too.

ComfyUI sets the patches when it loads the clone (the user's CLIP in a stock node afterwards gets its own modules
back). Graphs only on a ComfyUI with ON_DETACH callbacks, where their memory goes when ComfyUI unloads the text
encoder (as for the VAE, hosts/comfyui/vae_accel.py); elsewhere, and for a CLIP on the CPU, the input CLIP is
returned with the reason.
"""
import torch

from ...engine.graphs.graphed_forward import GraphedForward, Policy
from . import graphs_on_unload

_ENCODER_CLASS = ("comfy.clip_model", "CLIPEncoder")


def accelerate_clip(clip, cuda_graph=True):
    """(accelerated copy of `clip`, info); `clip` itself where nothing applies, with the reason in
    info["reasons"]."""
    why = _stock_reason(clip, cuda_graph)
    if why:
        return clip, _info(reasons={"cuda_graph": why})
    return patched_copy(clip)


def _info(reasons=None):
    return {"encoders": [], "reasons": reasons or {}, "forwards": {}}


def patched_copy(clip):
    """(`clip.clone()` with the encoders' GraphedForwards as object patches, info): accelerate_clip's copy, once
    it found nothing against one."""
    info = _info()
    out = clip.clone()
    for name, sd_clip in text_encoders(out.cond_stage_model):
        encoder = sd_clip.transformer.text_model.encoder
        gf = GraphedForward(encoder, "text encoder " + name, cuda_graph=True, channels_last=False,
                            policy=Policy(refuse=_weight_function_rule(encoder)))
        path = "%s.transformer.text_model.encoder.forward" % name
        out.patcher.add_object_patch(path, gf)
        info["encoders"].append(name)
        info["forwards"][name] = gf
    graphs_on_unload.free_graphs_on_unload(out.patcher, info["forwards"])
    return out, info


def text_encoders(cond_stage_model):
    """[(attribute name, SDClipModel)] of the CLIP text encoders directly under `cond_stage_model`."""
    found = []
    for name, m in cond_stage_model.named_children():
        enc = getattr(getattr(getattr(m, "transformer", None), "text_model", None), "encoder", None)
        if enc is not None and (type(enc).__module__, type(enc).__name__) == _ENCODER_CLASS:
            found.append((name, m))
    return found


def _stock_reason(clip, cuda_graph):
    if not cuda_graph:
        return "off"
    patcher = getattr(clip, "patcher", None)
    model = getattr(clip, "cond_stage_model", None)
    if patcher is None or getattr(patcher, "model", None) is not model or not hasattr(clip, "clone"):
        return "this CLIP holds no ModelPatcher of its text encoders"
    if not text_encoders(model):
        return ("no CLIP text encoder in %s (T5 and other text encoders run their own modules)"
                % type(model).__name__)
    device = torch.device(getattr(patcher, "load_device", "cpu"))
    if device.type != "cuda":
        return "text encoder on %s: CUDA graphs need a CUDA GPU" % device.type
    return graphs_on_unload.no_detach_reason(patcher, "text encoder")


def _weight_function_rule(encoder):
    casts = [m for m in encoder.modules() if hasattr(m, "weight_function")]

    def refuse(args, kwargs):
        for m in casts:
            if m.weight_function or m.bias_function:
                return ("a weight function ComfyUI runs by Python on every call (a low-VRAM LoRA patch, a weight "
                        "wrapper) is on %s" % type(m).__name__)
        return None
    return refuse


def patched_line(info):
    """One line of what `accelerate_clip` put on the copy."""
    if info["reasons"]:
        return "text encoders: stock (%s)" % "; ".join("%s: %s" % kv for kv in info["reasons"].items())
    return "text encoders %s: a CUDA graph per prompt length and output layer" % ", ".join(info["encoders"])
