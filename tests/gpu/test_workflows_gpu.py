"""Multi-sampler workflows users build, with CUDA graphs: a hires fix (a second sampler on the upscaled latent at
partial denoise, so one prompt samples at two resolutions) and a base/refiner-style split over one schedule with
KSamplerAdvanced (leftover noise handed from the first sampler to the second) on an Apply SD Accel model.
Each equals stock's latent within fp16 noise; the hires fix's second prompt replays both resolutions' graphs
without capturing again. Also SamplerCustomAdvanced with each of ComfyUI's guiders on an Apply SD Accel model.
"""
import pytest
import torch

from test_graphs_gpu import _rel, comfy_env  # noqa: F401  (the shared module fixture)

SEED, STEPS, CFG = 5, 6, 7.0


def _hires(env, ours):
    """(final latent, [reports of our two samplers] or None): 256² txt2img, latent upscaled 1.5x (bicubic), then
    the same model at denoise 0.55 on it, as ComfyUI's hires-fix example graph does."""
    n = env.nodes
    with torch.inference_mode():
        lat = n.EmptyLatentImage().generate(256, 256, 1)[0]
        reports = []

        def sample(latent, denoise):
            args = (env.model, SEED, STEPS, CFG, "euler", "normal", env.pos, env.neg, latent)
            if ours:
                res = env.ours.sample(*args, denoise=denoise)
                reports.append(res["ui"]["sdaccel_report"][0])
                return res["result"][0]
            return n.KSampler().sample(*args, denoise=denoise)[0]
        base = sample(lat, 1.0)
        up = n.LatentUpscaleBy().upscale(base, "bicubic", 1.5)[0]
        final = sample(up, 0.55)
    return final["samples"].float(), (reports if ours else None)


def test_hires_fix_equals_stock_and_its_second_prompt_replays_both_resolutions(comfy_env):
    stock, _ = _hires(comfy_env, ours=False)
    assert stock.shape[-1] == 48 and torch.isfinite(stock).all()
    first, _ = _hires(comfy_env, ours=True)
    second, reports = _hires(comfy_env, ours=True)
    assert _rel(first, stock) < 2e-2 and _rel(second, stock) < 2e-2, (_rel(first, stock), _rel(second, stock))
    for rep in reports:
        g = rep["graphs"]
        assert g["replays"] >= 1 and g["captures"] == 0 and not g.get("refused"), g


def _split(env, model):
    """Steps 0-3 with leftover noise, then 3-6 without adding noise: KSamplerAdvanced twice on `model`."""
    n = env.nodes
    adv = n.KSamplerAdvanced()
    with torch.inference_mode():
        lat = n.EmptyLatentImage().generate(256, 256, 1)[0]
        mid = adv.sample(model, "enable", SEED, STEPS, CFG, "dpmpp_2m", "karras", env.pos, env.neg, lat, 0, 3,
                         "enable")[0]
        out = adv.sample(model, "disable", SEED, STEPS, CFG, "dpmpp_2m", "karras", env.pos, env.neg, mid, 3, 10000,
                         "disable")[0]
    return mid["samples"].float(), out["samples"].float()


def test_a_split_schedule_on_an_apply_sd_accel_model_equals_stock(comfy_env):
    from sd_accel.nodes.sampler_nodes import SDAccelApply
    stock_mid, stock = _split(comfy_env, comfy_env.model)
    ours_model = SDAccelApply().apply(comfy_env.model)["result"][0]
    errs = []
    for _ in range(2):      # the second pass runs on the first one's graphs
        mid, out = _split(comfy_env, ours_model)
        errs += [_rel(mid, stock_mid), _rel(out, stock)]
    # within fp16 noise of stock, and the second half's own effect well above that noise: a skipped or stale
    # second half could not pass
    assert max(errs) < 2e-2 and _rel(stock_mid, stock) > 4 * max(errs), (errs, _rel(stock_mid, stock))


def _custom_advanced(env, model, guider):
    """SamplerCustomAdvanced (random noise, dpmpp_2m, karras sigmas for STEPS) with one of ComfyUI's guiders on
    `model`: CFG, dual CFG (a second prompt: three conds per call), PerpNeg (an empty cond beside the two), basic."""
    from comfy_extras import nodes_custom_sampler as cs
    from comfy_extras import nodes_perpneg
    n = env.nodes
    with torch.inference_mode():
        second = n.CLIPTextEncode().encode(env.clip, "in the snow")[0]
        empty = n.CLIPTextEncode().encode(env.clip, "")[0]
        guiders = {
            "cfg": lambda: cs.CFGGuider().get_guider(model, env.pos, env.neg, CFG)[0],
            "dual_cfg": lambda: cs.DualCFGGuider().get_guider(model, env.pos, second, env.neg, CFG, 3.0, "regular")[0],
            "perp_neg": lambda: nodes_perpneg.PerpNegGuider.execute(model, env.pos, env.neg, empty, CFG, 1.5)[0],
            "basic": lambda: cs.BasicGuider().get_guider(model, env.pos)[0],
        }
        lat = n.EmptyLatentImage().generate(256, 256, 1)[0]
        sigmas = cs.BasicScheduler().get_sigmas(model, "karras", STEPS, 1.0)[0]
        out = cs.SamplerCustomAdvanced().sample(cs.RandomNoise().get_noise(SEED)[0], guiders[guider](),
                                                cs.KSamplerSelect().get_sampler("dpmpp_2m")[0], sigmas, lat)[0]
    return out["samples"].float()


@pytest.mark.parametrize("guider", ["cfg", "dual_cfg", "perp_neg", "basic"])
def test_sampler_custom_advanced_with_each_guider_on_an_apply_sd_accel_model_equals_stock(comfy_env, guider):
    """Each guider calls the UNet with its own batch of conds (3 rows for dual CFG and PerpNeg, 1 for basic): a
    graph per batch, the second run replaying them, within fp16 noise of stock."""
    from sd_accel.nodes.sampler_nodes import SDAccelApply
    stock = _custom_advanced(comfy_env, comfy_env.model, guider)
    ours_model = SDAccelApply().apply(comfy_env.model)["result"][0]
    errs = [_rel(_custom_advanced(comfy_env, ours_model, guider), stock) for _ in range(2)]
    assert torch.isfinite(stock).all() and max(errs) < 2e-2, (guider, errs)
