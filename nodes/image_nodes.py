"""Save Image (SD Accel): SaveImage's files with the PNG compression level as an input (hosts/comfyui/png_save.py)."""
from ..hosts.comfyui import png_save


class SDAccelSaveImage:
    DESCRIPTION = ("Saves images to your ComfyUI output directory as Save Image does: the same file names, the same "
                   "pixels, the prompt and workflow embedded the same way. PNG is lossless at every compression "
                   "level; a lower level writes sooner and makes larger files (Save Image uses 4; 1, the default "
                   "here and Preview Image's level, takes about half the time for files about 13% larger). The "
                   "images of a batch are encoded in parallel.")
    CATEGORY = "SD Accel/image"
    RETURN_TYPES = ()
    FUNCTION = "save_images"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "images": ("IMAGE", {"tooltip": "The images to save."}),
                "filename_prefix": ("STRING", {"default": "ComfyUI", "tooltip": (
                    "The prefix for the file to save, as in Save Image (it may include formatting such as "
                    "%date:yyyy-MM-dd% or %Empty Latent Image.width%).")}),
            },
            # optional: an API prompt whose SaveImage is renamed to this node runs as it is
            "optional": {
                "compress_level": ("INT", {"default": png_save.DEFAULT_LEVEL, "min": 0, "max": 9, "tooltip": (
                    "PNG compression, 0 (none: fastest, largest files) to 9. Lossless at every level. Save Image "
                    "uses %d." % png_save.SAVEIMAGE_LEVEL)}),
            },
            "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"},
        }

    def save_images(self, images, filename_prefix="ComfyUI", compress_level=png_save.DEFAULT_LEVEL, prompt=None,
                    extra_pnginfo=None):
        return {"ui": {"images": png_save.save_images(images, filename_prefix, compress_level, prompt,
                                                      extra_pnginfo)}}


NODE_CLASS_MAPPINGS = {"SDAccelSaveImage": SDAccelSaveImage}
NODE_DISPLAY_NAME_MAPPINGS = {"SDAccelSaveImage": "Save Image (SD Accel)"}
