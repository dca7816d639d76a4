"""How AnimateDiff-Evolved hooks current ComfyUI (0.3.x, ModelPatcher with injections and keyed wrappers;
read in animatediff/model_injection.py, sampling.py): the motion model is an additional model of the UNet's
patcher, inserted into the UNet by a PatcherInjection when ComfyUI patches the model, taken out when it
unpatches; an OUTER_SAMPLE wrapper sets up the run (its state in transformer_options, the frame count, the
global swap of comfy.samplers.sampling_function, the v1 GroupNorm swap as a DIFFUSION_MODEL wrapper), a
CALC_COND_BATCH wrapper runs the sliding context windows.
"""
import math

import comfy.model_patcher
import comfy.patcher_extension as pe
import comfy.samplers
from comfy.model_patcher import ModelPatcher
from comfy.patcher_extension import PatcherInjection, WrappersMP

from . import motion as mm

ADE = "ADE"
PARAMS = "ADE_params"


def apply(model, motion, params):
    model = model.clone()
    patcher = ModelPatcher(motion, load_device=model.load_device, offload_device=model.offload_device)
    model.set_additional_models(ADE, [patcher])
    model.set_injections(ADE, [PatcherInjection(inject=inject_motion_models, eject=eject_motion_models)])
    model.set_model_forward_timestep_embed_patch((mm.TemporalModuleLike, forward_timestep_embed_patch))
    model.set_attachments(PARAMS, params)
    model.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, ADE)
    model.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, ADE, outer_sample_wrapper)
    model.remove_wrappers_with_key(WrappersMP.CALC_COND_BATCH, ADE)
    model.add_wrapper_with_key(WrappersMP.CALC_COND_BATCH, ADE, sliding_calc_cond_batch)
    return model


def _motion(patcher):
    return patcher.get_additional_models_with_key(ADE)[0].model


def inject_motion_models(patcher):
    _motion(patcher).inject(patcher.model.diffusion_model)


def eject_motion_models(patcher):
    _motion(patcher).eject(patcher.model.diffusion_model)


def forward_timestep_embed_patch(layer, x, emb, context, transformer_options, *args, **kwargs):
    return layer(x, context, transformer_options=transformer_options)


def outer_sample_wrapper(executor, *args, **kwargs):
    guider = executor.class_obj
    patcher = guider.model_patcher
    orig_options, orig_sampling_function = guider.model_options, comfy.samplers.sampling_function
    try:
        guider.model_options = comfy.model_patcher.create_model_options_clone(guider.model_options)
        args = list(args)
        state = mm.SamplingState(_motion(patcher), patcher.get_attachment(PARAMS), full_length=args[1].size(0))
        state.start()
        guider.model_options["transformer_options"]["ADGS"] = state
        if patcher.get_attachment(PARAMS)["motion_version"] == "v1":
            pe.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "ADE_groupnormed_diffusion_model",
                                    _groupnormed(state), guider.model_options, is_model_options=True)
        comfy.samplers.sampling_function = evolved_sampling_function
        args[-3] = _step_counting(args[-3], state)
        return executor(*args, **kwargs)
    finally:
        comfy.samplers.sampling_function = orig_sampling_function
        guider.model_options = orig_options


def _step_counting(callback, state):
    def ad_callback(step, x0, x, total_steps):
        if callback is not None:
            callback(step, x0, x, total_steps)
        state.current_step = step + 1
    return ad_callback


def evolved_sampling_function(model, x, timestep, uncond, cond, cond_scale, model_options={}, seed=None):  # noqa: B006
    state = model_options["transformer_options"]["ADGS"]
    model_options = model_options.copy()
    model_options["transformer_options"] = model_options["transformer_options"].copy()
    model_options["transformer_options"]["ad_params"] = state.exposed_params()
    uncond_ = uncond
    if math.isclose(cond_scale, 1.0) and not model_options.get("disable_cfg1_optimization", False):
        uncond_ = None
    cond_pred, uncond_pred = comfy.samplers.calc_cond_batch(model, [cond, uncond_], x, timestep, model_options)
    return comfy.samplers.cfg_function(model, cond_pred, uncond_pred, cond_scale, x, timestep, model_options, cond,
                                       uncond)


def sliding_calc_cond_batch(executor, model, conds, x_in, timestep, model_options):
    state = model_options["transformer_options"]["ADGS"]
    if not state.using_context():
        return executor(model, conds, x_in, timestep, model_options)
    return mm.run_windows(lambda c, x, t: executor(model, c, x, t, model_options), conds, x_in, timestep, state,
                          model_options["transformer_options"])


def _groupnormed(state):
    """AnimateDiff v1 models expect each GroupNorm to normalise across all frames of a video: for the diffusion
    model's call, the GroupNorm classes' forward are swapped (torch's and ComfyUI's cast-weights one)."""
    def wrapper(executor, *args, **kwargs):
        with mm.groupnorm_swapped(state):
            return executor(*args, **kwargs)
    return wrapper
