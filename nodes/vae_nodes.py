"""VAE Decode (SD Accel), VAE Encode (SD Accel) and Apply SD Accel (VAE): thin nodes over hosts/comfyui/vae.py
and hosts/comfyui/vae_accel.py."""
from ..hosts.comfyui import vae as host
from ..hosts.comfyui import vae_accel

_ACCEL_TOOLTIPS = {
    "fused_kernels": "Run the VAE's GroupNorm+SiLU pairs, its ResnetBlocks' biases and residual adds as fused Triton "
                     "kernels. Lossless (fp32 statistics). The stock modules run where a kernel cannot (CPU, no "
                     "Triton, old GPU, odd shapes), and the report says why.",
    "cuda_graph": "Replay each decode or encode call (each tile of a tiled one) from a CUDA graph captured per shape. "
                  "A graph keeps its working memory reserved between calls, so a call whose memory would be more "
                  "than 1/8 of the GPU's, or one under VAE Decode (SD Accel)'s budget_gib, runs without one, as do "
                  "all on ComfyUI 2024 or with --disable-cuda-malloc (the report says why).",
    "channels_last": "Run the VAE's convolutions in channels_last (NHWC): its conv weights are converted in place "
                     "before the first GPU call (values unchanged), as ComfyUI's --force-channels-last does. GPU, fp16 and bf16 "
                     "VAEs only (an fp32 VAE keeps stock's layout).",
}
VAE_ACCEL_INPUTS = {name: ("BOOLEAN", {"default": True, "tooltip": tip}) for name, tip in _ACCEL_TOOLTIPS.items()}


def _options(fused_kernels=True, cuda_graph=True, channels_last=True):
    return vae_accel.VAEOptions(bool(fused_kernels), bool(cuda_graph), bool(channels_last))


class _VAENode:
    """What the VAE Decode and VAE Encode nodes share: their category, and inputs of their own followed by the
    acceleration options."""
    CATEGORY = "SD Accel/vae"
    REQUIRED, OPTIONAL = {}, {}

    @classmethod
    def INPUT_TYPES(cls):
        # optional, so workflows saved before they existed still load
        return {"required": dict(cls.REQUIRED), "optional": {**cls.OPTIONAL, **VAE_ACCEL_INPUTS}}


class SDAccelVAEDecode(_VAENode):
    DESCRIPTION = ("VAE Decode, accelerated and planned for memory: fused kernels, channels_last and CUDA graphs "
                   "in the VAE (lossless), and a decode of the whole image when ComfyUI's estimate of the decode "
                   "plus the VAE's weights fits the budget (or the GPU's free memory), otherwise in the largest "
                   "tiles that fit, instead of running out of memory first. Same inputs and IMAGE output as VAE "
                   "Decode; reports the choice, the decode's peak VRAM and what ran or fell back.")
    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The decoded image, as VAE Decode gives it.",)
    FUNCTION = "decode"
    REQUIRED = {
        "samples": ("LATENT", {"tooltip": "The latent to decode."}),
        "vae": ("VAE", {"tooltip": "The VAE, as for VAE Decode."}),
        "budget_gib": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.25, "tooltip":
                       "Memory the decode may use, VAE weights included, in GiB. 0: the GPU's free memory "
                       "at decode time. Tiled decoding is chosen when the whole decode would not fit; "
                       "tiles can show faint seams, as with VAE Decode (Tiled)."}),
    }
    OPTIONAL = {
        "release_cache": (["after_decode", "never"], {"default": "after_decode", "tooltip":
                          "after_decode: give the allocator's cached blocks back to the GPU once the image "
                          "is decoded (the decode's working memory, GiBs at 1024 px, otherwise stays "
                          "reserved by this process until the next cleanup). never: keep them cached, as "
                          "VAE Decode does."}),
    }

    def decode(self, samples, vae, budget_gib=0.0, release_cache="after_decode", **accel):
        images, line, ui = host.decode(vae, samples, budget_gib, release_cache, _options(**accel))
        return {"ui": {"text": [line], "sdaccel_memory": [ui]}, "result": (images,)}


class SDAccelVAEEncode(_VAENode):
    DESCRIPTION = ("VAE Encode, accelerated: fused kernels, channels_last and CUDA graphs in the VAE's encoder "
                   "(lossless). Same inputs and LATENT output as VAE Encode, ComfyUI's tiled retry after an "
                   "out-of-memory error included; reports the encode's peak VRAM and what ran or fell back.")
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The latent, as VAE Encode gives it.",)
    FUNCTION = "encode"
    REQUIRED = {
        "pixels": ("IMAGE", {"tooltip": "The image to encode (its first three channels)."}),
        "vae": ("VAE", {"tooltip": "The VAE, as for VAE Encode."}),
    }

    def encode(self, pixels, vae, **accel):
        latent, line, ui = host.encode(vae, pixels, _options(**accel))
        return {"ui": {"text": [line], "sdaccel_vae": [ui]}, "result": (latent,)}


class SDAccelApplyVAE:
    DESCRIPTION = ("Applies SD Accel to a VAE, for graphs that decode or encode with ComfyUI's own nodes (VAE "
                   "Decode, VAE Encode, their tiled versions, inpainting encodes): the output is a copy of the VAE "
                   "whose model patcher is a clone with SD Accel's module swaps and CUDA graphs as object patches, "
                   "the ComfyUI way. The input VAE is untouched: removing this node restores stock behaviour.")
    CATEGORY = "SD Accel/patches"
    RETURN_TYPES = ("VAE",)
    OUTPUT_TOOLTIPS = ("The same VAE, accelerated (a copy; lossless).",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("VAE", {"tooltip": "The VAE to accelerate (SD, SDXL, SD3 and Flux VAEs)."}),
                             **VAE_ACCEL_INPUTS}}

    def apply(self, vae, **accel):
        acc, info = vae_accel.accelerate_vae(vae, _options(**accel))
        return {"ui": {"text": [vae_accel.patched_line(info)]}, "result": (acc,)}


NODE_CLASS_MAPPINGS = {"SDAccelVAEDecode": SDAccelVAEDecode, "SDAccelVAEEncode": SDAccelVAEEncode,
                       "SDAccelApplyVAE": SDAccelApplyVAE}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelVAEDecode": "VAE Decode (SD Accel)", "SDAccelVAEEncode": "VAE Encode (SD Accel)",
                              "SDAccelApplyVAE": "Apply SD Accel (VAE)"}
