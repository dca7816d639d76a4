"""How AnimateDiff-Evolved hooked the 2024 ComfyUI, which has no injections and no keyed wrappers (read at its
2024-04-30 commit 7cfc558: animatediff/model_injection.py, sampling.py, nodes.py): the model becomes a
ModelPatcher subclass whose patch_model injects the motion modules after ComfyUI's own patching and whose
unpatch_model ejects them first; `comfy.sample.sample` is replaced for good at import (a pass-through for
any other model), and while an AnimateDiff model samples, three module globals are swapped:
openaimodel.forward_timestep_embed (to call the temporal modules), comfy.samplers.sampling_function (the
sliding context windows) and, for v1 models, the GroupNorm forwards.
"""
import copy
import math

import comfy.sample
import comfy.samplers
from comfy.ldm.modules.diffusionmodules import openaimodel
from comfy.model_patcher import ModelPatcher

from . import motion as mm


class ModelPatcherAndInjectorLike(ModelPatcher):
    """The 2024 AnimateDiff's ModelPatcherAndInjector: a clone() that keeps the subclass and its motion model."""

    @classmethod
    def create_from(cls, m):
        n = cls(m.model, m.load_device, m.offload_device, m.size, m.current_device,
                weight_inplace_update=m.weight_inplace_update)
        n.patches = {k: v[:] for k, v in m.patches.items()}
        n.patches_uuid = m.patches_uuid
        n.object_patches = m.object_patches.copy()
        n.model_options = copy.deepcopy(m.model_options)
        n.model_keys = m.model_keys
        n.backup, n.object_patches_backup = m.backup, m.object_patches_backup
        n.motion, n.motion_params = getattr(m, "motion", None), getattr(m, "motion_params", None)
        return n

    def clone(self):
        return ModelPatcherAndInjectorLike.create_from(self)

    def patch_model(self, *args, **kwargs):
        out = super().patch_model(*args, **kwargs)
        # the 2024 AnimateDiff loaded its motion models beside the UNet (a swap of get_additional_models):
        # here they follow the UNet's device when injected
        self.motion.to(next(self.model.diffusion_model.parameters()).device)
        self.motion.inject(self.model.diffusion_model)
        return out

    def unpatch_model(self, *args, **kwargs):
        self.motion.eject(self.model.diffusion_model)
        return super().unpatch_model(*args, **kwargs)


def apply(model, motion, params):
    model = ModelPatcherAndInjectorLike.create_from(model)
    model.motion, model.motion_params = motion, params
    return model


def install():
    """At import, as the 2024 AnimateDiff's nodes.py did."""
    if not getattr(comfy.sample.sample, "standin_motion_sample", False):
        comfy.sample.sample = motion_sample_factory(comfy.sample.sample)


def motion_sample_factory(orig_sample):
    def motion_sample(model, noise, *args, **kwargs):
        if type(model) is not ModelPatcherAndInjectorLike:
            return orig_sample(model, noise, *args, **kwargs)
        state = mm.SamplingState(model.motion, model.motion_params, full_length=args[-1].size(0))
        state.start()
        saved = openaimodel.forward_timestep_embed, comfy.samplers.sampling_function
        v1 = model.motion_params["motion_version"] == "v1"
        gn = mm.groupnorm_swapped(state, _manual_cast_groupnorm()) if v1 else None
        try:
            openaimodel.forward_timestep_embed = forward_timestep_embed
            comfy.samplers.sampling_function = evolved_sampling_function_factory(state)
            if gn is not None:
                gn.__enter__()
            kwargs["callback"] = _step_counting(kwargs.get("callback"), state)
            return orig_sample(model, noise, *args, **kwargs)
        finally:
            if gn is not None:
                gn.__exit__()
            openaimodel.forward_timestep_embed, comfy.samplers.sampling_function = saved
    motion_sample.standin_motion_sample = True
    return motion_sample


def _manual_cast_groupnorm():
    import comfy.ops
    return comfy.ops.manual_cast.GroupNorm


def _step_counting(callback, state):
    def ad_callback(step, x0, x, total_steps):
        if callback is not None:
            callback(step, x0, x, total_steps)
        state.current_step = step + 1
    return ad_callback


_ORIG_FORWARD_TIMESTEP_EMBED = openaimodel.forward_timestep_embed


def forward_timestep_embed(ts, x, emb, context=None, transformer_options={}, *args, **kwargs):  # noqa: B006
    """The host's own function, with the temporal modules called as AnimateDiff's replacement calls them."""
    for layer in ts:
        if isinstance(layer, mm.TemporalModuleLike):
            x = layer(x, context)
        else:
            x = _ORIG_FORWARD_TIMESTEP_EMBED([layer], x, emb, context, transformer_options, *args, **kwargs)
    return x


def evolved_sampling_function_factory(state):
    """The 2024 AnimateDiff's sampling function: ad_params in transformer_options, the sliding windows around
    ComfyUI's calc_cond_uncond_batch, then CFG as the 2024 ComfyUI computes it."""
    def evolved_sampling_function(model, x, timestep, uncond, cond, cond_scale, model_options={},  # noqa: B006
                                  seed=None):
        uncond_ = uncond
        if math.isclose(cond_scale, 1.0) and not model_options.get("disable_cfg1_optimization", False):
            uncond_ = None
        model_options = model_options.copy()
        to = model_options["transformer_options"] = dict(model_options.get("transformer_options", {}))
        to["ad_params"] = state.exposed_params()

        def batch(conds, xx, t):
            return comfy.samplers.calc_cond_uncond_batch(model, conds[0], conds[1], xx, t, model_options)
        if state.using_context():
            cond_pred, uncond_pred = mm.run_windows(batch, [cond, uncond_], x, timestep, state, to)
        else:
            cond_pred, uncond_pred = batch([cond, uncond_], x, timestep)
        return _cfg(model, x, timestep, cond, uncond, cond_pred, uncond_pred, cond_scale, model_options)
    return evolved_sampling_function


def _cfg(model, x, timestep, cond, uncond, cond_pred, uncond_pred, cond_scale, model_options):
    if "sampler_cfg_function" in model_options:
        args = {"cond": x - cond_pred, "uncond": x - uncond_pred, "cond_scale": cond_scale, "timestep": timestep,
                "input": x, "sigma": timestep}
        result = x - model_options["sampler_cfg_function"](args)
    else:
        result = uncond_pred + (cond_pred - uncond_pred) * cond_scale
    for fn in model_options.get("sampler_post_cfg_function", []):
        result = fn({"denoised": result, "cond": cond, "uncond": uncond, "model": model, "uncond_denoised": uncond_pred,
                     "cond_denoised": cond_pred, "sigma": timestep, "model_options": model_options, "input": x})
    return result
