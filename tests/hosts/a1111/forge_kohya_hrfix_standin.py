"""Stand-in of Forge's built-in Kohya HRFix (lllyasviel/stable-diffusion-webui-forge, dfdcbab6,
`extensions-builtin/sd_forge_kohya_hrfix/scripts/kohya_hrfix.py`) and of what Forge's built-in SAG reads from it
(`extensions-builtin/sd_forge_sag/scripts/forge_sag.py`); the mechanism reproduced, not the code.

The HRFix patches (Deep Shrink: the features downscaled after one input block while the step's sigma lies in the
user's start/end range, scaled back up in the output blocks) store the shape they leave the features in on a
module, `modules.shared.kohya_shrink_shape`, on every block call. SAG's post-CFG function reads it after the step,
when its attention map's size does not match the latent's, to fold the map back at the shrunk size. The stored
value is neither in the step's arguments nor in its result: a replay that does not store it leaves another
step's shape there.
"""
import types

import torch

shared = types.ModuleType("modules.shared")   # Forge's `modules.shared`: the patches store into it


def patch_add_downscale(unet_patcher, block_number, downscale_factor, start_percent, end_percent):
    """A clone with the patches set as the extension sets them (downscale after the skip), the sigmas read where
    ComfyUI keeps the model's schedule (Forge's patcher: `model.predictor`)."""
    sampling = unet_patcher.get_model_object("model_sampling")
    sigma_start, sigma_end = sampling.percent_to_sigma(start_percent), sampling.percent_to_sigma(end_percent)

    def input_block_patch(h, transformer_options):
        if transformer_options["block"][1] == block_number:
            sigma = transformer_options["sigmas"][0].item()
            if sigma_end <= sigma <= sigma_start:
                size = (round(h.shape[-2] / downscale_factor), round(h.shape[-1] / downscale_factor))
                h = torch.nn.functional.interpolate(h, size=size, mode="bicubic")
        shared.kohya_shrink_shape = (h.shape[-1], h.shape[-2])
        shared.kohya_shrink_shape_out = None
        return h

    def output_block_patch(h, hsp, transformer_options):
        if h.shape[2] != hsp.shape[2]:
            h = torch.nn.functional.interpolate(h, size=hsp.shape[-2:], mode="bicubic")
        shared.kohya_shrink_shape_out = (h.shape[-1], h.shape[-2])
        return h, hsp

    m = unet_patcher.clone()
    m.set_model_input_block_patch_after_skip(input_block_patch)
    m.set_model_output_block_patch(output_block_patch)
    return m


def shrink_shape_seen_after_each_step(unet_patcher, seen):
    """A clone whose post-CFG function reads the stored shape after each step, as Forge's SAG does, into `seen`."""
    def post_cfg(args):
        seen.append(getattr(shared, "kohya_shrink_shape", None))
        return args["denoised"]
    m = unet_patcher.clone()
    m.set_model_sampler_post_cfg_function(post_cfg)
    return m
