"""ComfyUI's conditioning nodes with CUDA graphs (the CPU server tests run the sampler without graphs): area and
mask conditioning (ComfyUI crops the latent per area, so one step calls the UNet with several shapes), a prompt
switched mid-run by timestep ranges, combined / averaged / concatenated / zeroed conds, a latent noise mask, and
Differential Diffusion (a soft noise mask made binary per step, around the model call, by a model patch).

Per case, on the current ComfyUI in process: stock KSampler, then the Accelerated KSampler twice with the same seed:
both equal stock's latent within fp16 noise, and the second prompt replays graphs without capturing again.
"""
import pytest
import torch

from test_graphs_gpu import _rel, comfy_env  # noqa: F401  (the shared module fixture)

SIZE = 256


def _encode(env, text):
    with torch.inference_mode():
        return env.nodes.CLIPTextEncode().encode(env.clip, text)[0]


def _half_mask():
    mask = torch.zeros((1, SIZE, SIZE))
    mask[:, :, : SIZE // 2] = 1.0
    return mask


def _soft_mask():
    return _half_mask() * 0.5 + 0.25


def _noised_latent():
    g = torch.Generator().manual_seed(3)
    return {"samples": torch.randn((1, 4, SIZE // 8, SIZE // 8), generator=g)}


def _case(env, name):
    """(model, positive, negative, latent) of case `name`, built with ComfyUI's own nodes."""
    n = env.nodes
    dog = _encode(env, "a dog in the snow")
    model = env.model
    with torch.inference_mode():
        latent = n.EmptyLatentImage().generate(SIZE, SIZE, 1)[0]
        pos, neg = env.pos, env.neg
        if name == "area":
            area = n.ConditioningSetArea().append(dog, SIZE // 2, SIZE // 2, 0, 0, 1.0)[0]
            pos = n.ConditioningCombine().combine(env.pos, area)[0]
        elif name == "two_areas_and_percentage":
            left = n.ConditioningSetArea().append(dog, SIZE // 2, SIZE, 0, 0, 0.8)[0]
            corner = n.ConditioningSetAreaPercentage().append(env.pos, 0.25, 0.5, 0.75, 0.5, 1.0)[0]
            pos = n.ConditioningCombine().combine(n.ConditioningCombine().combine(env.pos, left)[0], corner)[0]
        elif name == "mask":
            masked = n.ConditioningSetMask().append(dog, _half_mask(), "default", 1.0)[0]
            pos = n.ConditioningCombine().combine(env.pos, masked)[0]
        elif name == "mask_bounds":
            masked = n.ConditioningSetMask().append(dog, _half_mask(), "mask bounds", 1.0)[0]
            pos = n.ConditioningCombine().combine(env.pos, masked)[0]
        elif name == "timestep_range":
            first = n.ConditioningSetTimestepRange().set_range(env.pos, 0.0, 0.3)[0]
            second = n.ConditioningSetTimestepRange().set_range(dog, 0.3, 1.0)[0]
            pos = n.ConditioningCombine().combine(first, second)[0]
        elif name == "average":
            pos = n.ConditioningAverage().addWeighted(env.pos, dog, 0.3)[0]
        elif name == "concat":
            pos = n.ConditioningConcat().concat(env.pos, dog)[0]
        elif name == "zero_out_negative":
            neg = n.ConditioningZeroOut().zero_out(env.neg)[0]
        elif name == "latent_noise_mask":
            latent = n.SetLatentNoiseMask().set_mask(_noised_latent(), _half_mask())[0]
        elif name == "differential_diffusion":
            latent = n.SetLatentNoiseMask().set_mask(_noised_latent(), _soft_mask())[0]
            import patch_nodes   # dev/, on sys.path once the comfy_env fixture has run
            model = patch_nodes.apply_node("DifferentialDiffusion", env.model, {})
        else:
            raise KeyError(name)
    return model, pos, neg, latent


CASES = ["area", "two_areas_and_percentage", "mask", "mask_bounds", "timestep_range", "average", "concat",
         "zero_out_negative", "latent_noise_mask", "differential_diffusion"]
MASKED = ("latent_noise_mask", "differential_diffusion")


def _run(env, model, pos, neg, latent, ours, denoise):
    with torch.inference_mode():
        args = (model, 5, 6, 7.0, "euler", "normal", pos, neg, latent)
        if ours:
            res = env.ours.sample(*args, denoise=denoise)
            return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]
        return env.nodes.KSampler().sample(*args, denoise=denoise)[0]["samples"].float(), None


@pytest.mark.parametrize("name", CASES)
def test_conditioning_with_graphs_equals_stock_and_reuses_its_graphs(comfy_env, name):
    model, pos, neg, latent = _case(comfy_env, name)
    denoise = 0.7 if name in MASKED else 1.0
    stock, _ = _run(comfy_env, model, pos, neg, latent, ours=False, denoise=denoise)
    # what a replay that ignored the node would give: the plain prompt (and, for the timestep ranges, the second
    # prompt over the whole run, had the switch been missed the other way; for Differential Diffusion, its soft
    # mask as it is)
    unmasked = {"samples": latent["samples"]}
    ignored = [_run(comfy_env, comfy_env.model, comfy_env.pos, comfy_env.neg, unmasked, ours=False,
                    denoise=denoise)[0]]
    if name == "timestep_range":
        ignored.append(_run(comfy_env, model, _encode(comfy_env, "a dog in the snow"), neg, latent, ours=False,
                            denoise=denoise)[0])
    if name == "differential_diffusion":
        ignored.append(_run(comfy_env, comfy_env.model, pos, neg, latent, ours=False, denoise=denoise)[0])
    first, rep1 = _run(comfy_env, model, pos, neg, latent, ours=True, denoise=denoise)
    second, rep2 = _run(comfy_env, model, pos, neg, latent, ours=True, denoise=denoise)
    assert torch.isfinite(stock).all()
    err = max(_rel(first, stock), _rel(second, stock))
    effect = min(_rel(stock, other) for other in ignored)
    # ours within fp16 noise of stock, and the node's effect well above that noise (else this could not fail)
    assert err < 2e-2 and effect > 4 * err, (name, err, effect)
    assert rep1["graphs"]["replays"] >= 1, rep1["graphs"]
    g = rep2["graphs"]
    assert g["replays"] >= 1 and g["captures"] == 0 and not g.get("refused"), g
