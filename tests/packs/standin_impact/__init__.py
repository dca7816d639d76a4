"""Test stand-in for ltdrdata/ComfyUI-Impact-Pack's detailers (DetailerForEach / FaceDetailer): a node that
samples again, inside itself, a crop of the image at another size (read in modules/impact/impact_pack.py
DetailerForEach.do_detail, core.py enhance_detail, impact_sampling.py, utils.py). docs/other_packs.md.

Per region: crop, upscale with Lanczos so the short side is `guide_size` (a latent of another shape than the
main pass), VAE encode, a noise mask for the inner part when asked (and ComfyUI's DifferentialDiffusion on
the model when the mask is feathered), sample, decode, downscale, paste back through the blurred mask.
The sampling is Impact's own (`separated_sample`: sigmas computed for steps/denoise and cut, ComfyUI's
sampler object, `comfy.sample.sample_custom` with a preview callback that keeps x0, and the denoised x0 as
the result), or a KSampler node called inside the node, as Impact's KSampler providers and wrappers do:
ComfyUI's KSampler or SD Accel's Accelerated KSampler, looked up by name. An Accelerated KSampler's report is
passed on in this node's ui, so the tests can read it. Used only by the tests.
"""
import math

import numpy as np
import torch
from PIL import Image

import comfy.sample
import comfy.samplers
import comfy.utils
import nodes


def tensor_resize(image, w, h):
    """Impact's tensor_resize: each image through PIL with Lanczos."""
    out = []
    for single in image:
        pil = Image.fromarray(np.clip(255.0 * single.cpu().numpy(), 0, 255).astype(np.uint8))
        out.append(torch.from_numpy(np.array(pil.resize((w, h), resample=Image.LANCZOS)).astype(np.float32) / 255.0))
    return torch.stack(out)


def blurred_mask(h, w, feather):
    """The region's mask: the inner half of the crop, blurred by `feather` px (Impact's cropped_mask blurred)."""
    mask = torch.zeros(1, 1, h, w)
    mask[..., h // 4:h - h // 4, w // 4:w - w // 4] = 1.0
    if feather > 0:
        k = 2 * feather + 1
        padded = torch.nn.functional.pad(mask, [feather] * 4, mode="replicate")
        mask = torch.nn.functional.avg_pool2d(padded, k, stride=1)
    return mask[0, 0]


def differential_diffusion(model):
    """ComfyUI's DifferentialDiffusion on the model, as Impact applies it for a feathered noise mask (a node
    class with apply() in the 2024 ComfyUI, a schema node with execute() now)."""
    from comfy_extras.nodes_differential_diffusion import DifferentialDiffusion
    if hasattr(DifferentialDiffusion, "apply"):
        return DifferentialDiffusion().apply(model)[0]
    return DifferentialDiffusion.execute(model).args[0]


def calculate_sigmas(model, scheduler, steps):
    if hasattr(comfy.samplers, "calculate_sigmas"):
        return comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), scheduler, steps)
    return comfy.samplers.calculate_sigmas_scheduler(model.model, scheduler, steps)   # the 2024 ComfyUI


def separated_sample(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise):
    """Impact's ksampler_wrapper -> separated_sample -> sample_with_custom_noise, returning the denoised x0."""
    advanced_steps = math.floor(steps / denoise)
    sigmas = calculate_sigmas(model, scheduler, advanced_steps)[advanced_steps - steps:]
    sampler = comfy.samplers.sampler_object(sampler_name)
    samples = latent["samples"]
    noise = comfy.sample.prepare_noise(samples, seed, latent.get("batch_index"))
    x0 = {}

    def callback(step, x0_step, x, total_steps):
        x0["x0"] = x0_step
    comfy.sample.sample_custom(model, noise, cfg, sampler, sigmas, positive, negative, samples,
                               noise_mask=latent.get("noise_mask"), callback=callback,
                               disable_pbar=True, seed=seed)
    return model.model.process_latent_out(x0["x0"].cpu())


def node_sample(name, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise):
    """A KSampler node called inside this one; (latent samples, its ui or None)."""
    out = nodes.NODE_CLASS_MAPPINGS[name]().sample(model, seed, steps, cfg, sampler_name, scheduler, positive,
                                                   negative, latent, denoise=denoise)
    if isinstance(out, dict):
        return out["result"][0]["samples"], out.get("ui")
    return out[0]["samples"], None


class ImpactLikeDetailer:
    DESCRIPTION = "Test stand-in: Impact Pack's detailer, re-sampling one region at another size."
    CATEGORY = "sdaccel_tests"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "doit"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "image": ("IMAGE",), "model": ("MODEL",), "vae": ("VAE",),
            "positive": ("CONDITIONING",), "negative": ("CONDITIONING",),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
            "steps": ("INT", {"default": 2, "min": 1, "max": 100}),
            "cfg": ("FLOAT", {"default": 7.0, "min": 0.0, "max": 30.0}),
            "sampler_name": (comfy.samplers.KSampler.SAMPLERS,),
            "scheduler": (comfy.samplers.KSampler.SCHEDULERS,),
            "denoise": ("FLOAT", {"default": 0.5, "min": 0.01, "max": 1.0, "step": 0.01}),
            "crop": ("STRING", {"default": "16,16,48,48"}),    # x1,y1,x2,y2 in pixels: one detected region
            "guide_size": ("INT", {"default": 48, "min": 8, "max": 1024, "step": 8}),
            "noise_mask": ("BOOLEAN", {"default": True}),
            "noise_mask_feather": ("INT", {"default": 4, "min": 0, "max": 32}),
            "ksampler": (["impact", "KSampler", "SDAccelKSampler"], {"default": "impact"}),
        }}

    def doit(self, image, model, vae, positive, negative, seed, steps, cfg, sampler_name, scheduler, denoise, crop,
             guide_size, noise_mask, noise_mask_feather, ksampler):
        x1, y1, x2, y2 = (int(v) for v in crop.split(","))
        w, h = x2 - x1, y2 - y1
        upscale = guide_size / min(w, h)
        new_w, new_h = int(w * upscale), int(h * upscale)
        image = image.clone()
        cropped = image[:, y1:y2, x1:x2, :]
        mask = blurred_mask(h, w, noise_mask_feather)
        if noise_mask and noise_mask_feather > 0 and "denoise_mask_function" not in model.model_options:
            model = differential_diffusion(model)
        latent = nodes.VAEEncode().encode(vae, tensor_resize(cropped, new_w, new_h))[0]
        if noise_mask:
            latent["noise_mask"] = mask[None]
        ui = None
        if ksampler == "impact":
            samples = separated_sample(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent,
                                       denoise)
        else:
            samples, ui = node_sample(ksampler, model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                      latent, denoise)
        refined = tensor_resize(vae.decode(samples).cpu(), w, h)
        alpha = mask[None, :, :, None] if noise_mask else torch.ones(1, h, w, 1)
        image[:, y1:y2, x1:x2, :] = refined * alpha + cropped * (1 - alpha)
        if ui:
            return {"ui": ui, "result": (image,)}
        return (image,)


NODE_CLASS_MAPPINGS = {"ImpactLikeDetailer": ImpactLikeDetailer}
NODE_DISPLAY_NAME_MAPPINGS = {"ImpactLikeDetailer": "Impact-like Detailer (test stand-in)"}
