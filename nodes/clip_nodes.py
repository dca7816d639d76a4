"""Apply SD Accel (CLIP): a thin node over hosts/comfyui/clip_accel.py."""
from ..hosts.comfyui import clip_accel


class SDAccelApplyCLIP:
    DESCRIPTION = ("Applies SD Accel to a CLIP, for the text encoders of any graph (CLIP Text Encode, prompt "
                   "schedulers, conditioning nodes): the output is a copy of the CLIP whose model patcher is a clone "
                   "with each CLIP text encoder's layers replayed from a CUDA graph, the ComfyUI way. Same modules "
                   "and kernels as stock, so the same conditioning; an encode then costs a fraction of its Python "
                   "time. Tokenizers, prompt weights, embeddings, CLIP Set Last Layer, LoRAs and hooks work as with "
                   "the input CLIP. The input CLIP is untouched: removing this node restores stock behaviour.")
    CATEGORY = "SD Accel/patches"
    RETURN_TYPES = ("CLIP",)
    OUTPUT_TOOLTIPS = ("The same CLIP, accelerated (a copy; lossless). Put LoRA loaders before this node or after "
                       "it: either way the graphs follow the patched weights.",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "clip": ("CLIP", {"tooltip": "The CLIP to accelerate (SD1.5, SD2, SDXL text encoders)."}),
            "cuda_graph": ("BOOLEAN", {"default": True, "tooltip":
                           "Replay each text encoder's layers from a CUDA graph captured per prompt length and "
                           "output layer. A CUDA GPU and ComfyUI 0.3.x (its ON_DETACH callbacks free the graphs' "
                           "memory when ComfyUI unloads the text encoder); elsewhere the CLIP is passed through "
                           "and the node says why."}),
        }}

    def apply(self, clip, cuda_graph=True):
        out, info = clip_accel.accelerate_clip(clip, cuda_graph=bool(cuda_graph))
        return {"ui": {"text": [clip_accel.patched_line(info)]}, "result": (out,)}


NODE_CLASS_MAPPINGS = {"SDAccelApplyCLIP": SDAccelApplyCLIP}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelApplyCLIP": "Apply SD Accel (CLIP)"}
