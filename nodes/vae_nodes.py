"""VAE Decode (SD Accel): a thin node over hosts/comfyui/vae.py (whole when it fits the budget, planned tiles
when it does not)."""
from ..hosts.comfyui import vae as host


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
        images, line, ui = host.decode(vae, samples, budget_gib, release_cache)
        return {"ui": {"text": [line], "sdaccel_memory": [ui]}, "result": (images,)}


NODE_CLASS_MAPPINGS = {"SDAccelVAEDecode": SDAccelVAEDecode}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelVAEDecode": "VAE Decode (SD Accel)"}
