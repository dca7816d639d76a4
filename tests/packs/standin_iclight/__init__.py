"""Test stand-in for kijai/ComfyUI-IC-Light's nodes on an SD1.5 model (nodes.py `LoadAndApplyICLightUnet`, `ICLight`,
`ICLightConditioning`), as its current release patches ComfyUI:
  * `LoadAndApplyICLightUnet` reads an IC-Light UNet file (ldm keys) and adds every tensor of it to a clone as a
    "diff" weight patch; the input conv's patch carries `pad_weight`, so at load ComfyUI first pads the model's
    4-channel input conv with zeros to the file's 8 (fc) or 12 (fbc) channels: the patched UNet is wider than the
    one the checkpoint holds. It writes the file's channel count into the model config's `unet_config` (shared by
    every clone of the checkpoint, as the pack does) and puts its own `extra_conds` on the clone (an object patch
    of a bound method): the conditioning's `concat_latent_image`, resized to the batch, as `c_concat`.
  * `ICLightConditioning` puts the foreground latent (and an optional background, for fbc models) times the
    multiplier into both conditionings as `concat_latent_image`, and returns an empty latent of its size.
Current ComfyUI only: ComfyUI 2024's weight patches cannot pad (`pad_weight`), and the pack needs it. Not
reproduced: the diffusers-key conversion, the light-source and detail-transfer nodes. docs/other_packs.md. Used only
by the tests.
"""
import types

import torch

import comfy.conds
import comfy.utils
import folder_paths

_INPUT_CONV = "input_blocks.0.0.weight"


def _unet_files():
    for folder in ("diffusion_models", "unet"):
        try:
            return folder, folder_paths.get_filename_list(folder)
        except KeyError:
            continue
    return "unet", []


def extra_conds(self, **kwargs):
    """ComfyUI's extra_conds for the model, with the conditioning's concat_latent_image as c_concat."""
    out = {}
    image = kwargs.get("concat_latent_image", None)
    noise = kwargs.get("noise", None)
    device = kwargs["device"]
    in_channels = self.model_config.unet_config["in_channels"]
    if image is None:
        image = torch.zeros_like(noise)
    if image.shape[1] + 4 != in_channels:
        raise Exception("Input channels %d do not match the model's in_channels %d"
                        % (image.shape[1] + 4, in_channels))
    if image.shape[1:] != noise.shape[1:]:
        image = comfy.utils.common_upscale(image.to(device), noise.shape[-1], noise.shape[-2], "bilinear", "center")
    image = comfy.utils.resize_to_batch_size(image, noise.shape[0])
    out["c_concat"] = comfy.conds.CONDNoiseShape(image)
    cross_attn = kwargs.get("cross_attn", None)
    if cross_attn is not None:
        out["c_crossattn"] = comfy.conds.CONDCrossAttn(cross_attn)
    adm = self.encode_adm(**kwargs)
    if adm is not None:
        out["y"] = comfy.conds.CONDRegular(adm)
    return out


class ICLightLikeApply:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "model_path": (_unet_files()[1],)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing/stand-ins"

    def load(self, model, model_path):
        import comfy.model_management
        device = comfy.model_management.get_torch_device()
        dtype = comfy.model_management.unet_dtype()
        clone = model.clone()
        sd = comfy.utils.load_torch_file(folder_paths.get_full_path(_unet_files()[0], model_path))
        clone.model.model_config.unet_config["in_channels"] = sd[_INPUT_CONV].shape[1]
        clone.add_patches({"diffusion_model." + k: ("diff", [v.to(dtype=dtype, device=device),
                                                              {"pad_weight": k == _INPUT_CONV}])
                           for k, v in sd.items()})
        clone.add_object_patch("extra_conds", types.MethodType(extra_conds, clone.model))
        return (clone,)


class ICLightLikeConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"positive": ("CONDITIONING",), "negative": ("CONDITIONING",),
                             "foreground": ("LATENT",),
                             "multiplier": ("FLOAT", {"default": 0.18215, "min": 0.0, "max": 1.0, "step": 0.001})},
                "optional": {"opt_background": ("LATENT",)}}

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "negative", "empty_latent")
    FUNCTION = "encode"
    CATEGORY = "testing/stand-ins"

    def encode(self, positive, negative, foreground, multiplier, opt_background=None):
        fg = foreground["samples"]
        concat = fg if opt_background is None else torch.cat((fg, opt_background["samples"]), dim=1)
        out = []
        for conditioning in (positive, negative):
            c = []
            for t in conditioning:
                d = t[1].copy()
                d["concat_latent_image"] = concat * multiplier
                c.append([t[0], d])
            out.append(c)
        return (out[0], out[1], {"samples": torch.zeros_like(fg)})


NODE_CLASS_MAPPINGS = {"ICLightLikeApply": ICLightLikeApply, "ICLightLikeConditioning": ICLightLikeConditioning}
