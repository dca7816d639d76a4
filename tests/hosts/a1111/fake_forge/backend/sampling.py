"""Stand-in for Forge's sampling call of the UNet (backend/sampling/sampling_function.py): per batch, a
fresh copy of the patcher's transformer_options in the conds, then the patcher's `model_function_wrapper`
(when set) called with `apply_model` and {"input", "timestep", "c", "cond_or_uncond"}, else apply_model. The
patcher's ControlNets first: each link is given the batch's transformer_options, and the chain's control goes in
the conds (`control`, with the chain as `control_model`); the stand-in UNet does not read it."""
from . import memory_management


def denoise(patcher, x, sigma, context, lowvram=False):
    memory_management.load_models_gpu(patcher, lowvram=lowvram)
    to = dict(patcher.model_options.get("transformer_options", {}))
    to["cond_or_uncond"] = [0] * x.shape[0]
    c = {"c_crossattn": context, "transformer_options": to}
    t = sigma.expand(x.shape[0]).contiguous()
    control = getattr(patcher, "controlnet_linked_list", None)
    if control is not None:   # each ControlNet gets this batch's transformer_options, then the chain runs
        link = control
        while link is not None:
            link.transformer_options = to
            link = link.previous_controlnet
        c["control"] = control.get_control(x, patcher.model.predictor.timestep(t), dict(c), 1)
        c["control_model"] = control
    wrapper = patcher.model_options.get("model_function_wrapper")
    if wrapper is not None:
        return wrapper(patcher.model.apply_model, {"input": x, "timestep": t, "c": c, "cond_or_uncond": [0]})
    return patcher.model.apply_model(x, t, **c)
