"""Test stand-in for the DeepCache packs for ComfyUI (styler00dollar/ComfyUI-deepcache, DeepCache.py, and its forks
such as SoftMeng/ComfyUI-DeepCache-Fix): a `set_model_unet_function_wrapper` whose function never calls the model
function it is given. It converts the input as BaseModel.apply_model does (the model_sampling's calculate_input and
timestep, the conditioning cast to the UNet's dtype), runs the diffusion model's input, middle and output blocks in
its own loop (`forward_timestep_embed`, the control residuals and the input/output block patches where the UNet
applies them) and turns the output into the denoised latent (calculate_denoised). Its steps are counted by the
timestep going down (a rise starts a new run); on every `cache_interval`-th step it runs the whole UNet and keeps
the features entering output block `len - cache_depth - 1`; on the steps between it stops after input block
`cache_depth` and resumes from the kept features. docs/other_packs.md. Used only by the tests.
"""
import torch

from comfy.ldm.modules.diffusionmodules.openaimodel import apply_control, forward_timestep_embed
from comfy.ldm.modules.diffusionmodules.util import timestep_embedding


def _patched(transformer_options, name, *values):
    for p in transformer_options.get("patches", {}).get(name, []):
        values = p(*values, transformer_options)
        if not isinstance(values, tuple):
            values = (values,)
    return values


class DeepCacheLikeApply:
    CATEGORY = "tests/stand-ins"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "cache_interval": ("INT", {"default": 2, "min": 1, "max": 100}),
                             "cache_depth": ("INT", {"default": 1, "min": 0, "max": 12})}}

    def apply(self, model, cache_interval, cache_depth):
        new_model = model.clone()
        state = {"t": None, "step": -1, "kept": None}

        def unet_function(model_function, params):
            x_in, sigma, c = params["input"], params["timestep"], params["c"]
            base = new_model.model
            unet = base.diffusion_model
            to = dict(c.get("transformer_options") or {})
            dtype = unet.dtype
            x = base.model_sampling.calculate_input(sigma, x_in)
            if c.get("c_concat") is not None:
                x = torch.cat([x, c["c_concat"]], dim=1)
            x = x.to(dtype)
            t = base.model_sampling.timestep(sigma).float()
            context = c["c_crossattn"].to(dtype)
            y = c.get("y")
            control = c.get("control")
            now = float(t[0])
            if state["t"] is None or now > state["t"]:
                state["step"] = -1
            state["t"] = now
            state["step"] += 1
            full = state["step"] % cache_interval == 0
            to["original_shape"] = list(x.shape)

            emb = unet.time_embed(timestep_embedding(t, unet.model_channels, repeat_only=False).to(dtype))
            if unet.num_classes is not None:
                emb = emb + unet.label_emb(y.to(dtype))
            hs, h = [], x
            for i, block in enumerate(unet.input_blocks):
                to["block"] = ("input", i)
                h = forward_timestep_embed(block, h, emb, context, to)
                h = apply_control(h, control, "input")
                (h,) = _patched(to, "input_block_patch", h)
                hs.append(h)
                (h,) = _patched(to, "input_block_patch_after_skip", h)
                if not full and i == cache_depth:
                    break
            if full:
                to["block"] = ("middle", 0)
                h = forward_timestep_embed(unet.middle_block, h, emb, context, to)
                h = apply_control(h, control, "middle")
            resume = len(unet.output_blocks) - cache_depth - 1
            for i, block in enumerate(unet.output_blocks):
                if i < resume and not full:
                    continue
                if i == resume:
                    if full:
                        state["kept"] = h
                    else:
                        h = state["kept"]
                to["block"] = ("output", i)
                hsp = apply_control(hs.pop(), control, "output")
                h, hsp = _patched(to, "output_block_patch", h, hsp)
                h = torch.cat([h, hsp], dim=1)
                h = forward_timestep_embed(block, h, emb, context, to, hs[-1].shape if hs else None)
            out = unet.out(h.type(x.dtype))
            return base.model_sampling.calculate_denoised(sigma, out.float(), x_in)

        new_model.set_model_unet_function_wrapper(unet_function)
        return (new_model,)


NODE_CLASS_MAPPINGS = {"DeepCacheLikeApply": DeepCacheLikeApply}
