"""ComfyUI's conditioning nodes and multi-sampler graphs through the real server: what users wire between the text
encoders and the sampler (area, mask, timestep-range, average, concat, zero-out conditioning, a latent noise mask,
Differential Diffusion on a soft one) and graphs with two samplers (a hires fix; a KSamplerAdvanced split schedule
on an Apply SD Accel model).

Each graph is posted twice, with the stock samplers and with SD Accel's (fused_kernels off: on this CPU the
accelerated path then runs ComfyUI's own modules through its step wrapper, so any difference at all is a bug),
same seed: the saved latents must be equal bit for bit, and each case's node must change the output against the
graph without it (so the equality is about the node). tests/gpu/test_conditioning_gpu.py and
test_workflows_gpu.py run the same kinds of graphs with CUDA graphs.
"""
import itertools
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

SEED, STEPS, SIZE = 5, 3, 128   # 128 px: ConditioningSetArea takes areas of 64 px and more
POSITIVE, SECOND, NEGATIVE = "a photograph of an astronaut riding a horse", "a dog in the snow", "blurry"


def _base(ckpt):
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": POSITIVE, "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": NEGATIVE, "clip": ["4", 1]}},
        "16": {"class_type": "CLIPTextEncode", "inputs": {"text": SECOND, "clip": ["4", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        # a mask over the left half: zeros, with a half-width block of ones added at x = 0
        "40": {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": SIZE, "height": SIZE}},
        "41": {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": SIZE // 2, "height": SIZE}},
        "42": {"class_type": "MaskComposite", "inputs": {"destination": ["40", 0], "source": ["41", 0], "x": 0,
                                                         "y": 0, "operation": "add"}},
    }


def _conditioning(case):
    """{node id: node} of `case` and the (model, positive, negative, latent) links the sampler takes."""
    combine = lambda a, b: {"class_type": "ConditioningCombine",  # noqa: E731
                            "inputs": {"conditioning_1": a, "conditioning_2": b}}
    model, pos, neg, latent = ["4", 0], ["6", 0], ["7", 0], ["5", 0]
    nodes = {}
    if case == "area":
        nodes["50"] = {"class_type": "ConditioningSetArea", "inputs": {
            "conditioning": ["16", 0], "width": SIZE // 2, "height": SIZE // 2, "x": 0, "y": 0, "strength": 1.0}}
        nodes["51"] = combine(["6", 0], ["50", 0])
        pos = ["51", 0]
    elif case == "area_percentage":
        nodes["50"] = {"class_type": "ConditioningSetAreaPercentage", "inputs": {
            "conditioning": ["16", 0], "width": 0.5, "height": 1.0, "x": 0.5, "y": 0.0, "strength": 1.0}}
        nodes["51"] = combine(["6", 0], ["50", 0])
        pos = ["51", 0]
    elif case == "mask":
        nodes["50"] = {"class_type": "ConditioningSetMask", "inputs": {
            "conditioning": ["16", 0], "mask": ["42", 0], "set_cond_area": "default", "strength": 1.0}}
        nodes["51"] = combine(["6", 0], ["50", 0])
        pos = ["51", 0]
    elif case == "timestep_range":
        nodes["50"] = {"class_type": "ConditioningSetTimestepRange",
                       "inputs": {"conditioning": ["6", 0], "start": 0.0, "end": 0.3}}
        nodes["52"] = {"class_type": "ConditioningSetTimestepRange",
                       "inputs": {"conditioning": ["16", 0], "start": 0.3, "end": 1.0}}
        nodes["51"] = combine(["50", 0], ["52", 0])
        pos = ["51", 0]
    elif case == "average":
        nodes["50"] = {"class_type": "ConditioningAverage", "inputs": {
            "conditioning_to": ["6", 0], "conditioning_from": ["16", 0], "conditioning_to_strength": 0.3}}
        pos = ["50", 0]
    elif case == "concat":
        nodes["50"] = {"class_type": "ConditioningConcat",
                       "inputs": {"conditioning_to": ["6", 0], "conditioning_from": ["16", 0]}}
        pos = ["50", 0]
    elif case == "zero_out_negative":
        nodes["50"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["7", 0]}}
        neg = ["50", 0]
    elif case == "latent_noise_mask":
        nodes["50"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["5", 0], "mask": ["42", 0]}}
        latent = ["50", 0]
    elif case in ("soft_latent_noise_mask", "differential_diffusion"):
        # a soft mask (0.75 on the left half, 0.25 on the right): Differential Diffusion turns it into a
        # per-step binary mask from the step's timestep, in the inpainting wrapper around the model call
        nodes["53"] = {"class_type": "SolidMask", "inputs": {"value": 0.25, "width": SIZE, "height": SIZE}}
        nodes["54"] = {"class_type": "SolidMask", "inputs": {"value": 0.5, "width": SIZE // 2, "height": SIZE}}
        nodes["55"] = {"class_type": "MaskComposite", "inputs": {"destination": ["53", 0], "source": ["54", 0],
                                                                 "x": 0, "y": 0, "operation": "add"}}
        nodes["50"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["5", 0], "mask": ["55", 0]}}
        latent = ["50", 0]
        if case == "differential_diffusion":
            nodes["56"] = {"class_type": "DifferentialDiffusion", "inputs": {"model": model}}
            model = ["56", 0]
    elif case != "plain":
        raise KeyError(case)
    return nodes, model, pos, neg, latent


CASES = ["area", "area_percentage", "mask", "timestep_range", "average", "concat", "zero_out_negative",
         "latent_noise_mask", "differential_diffusion"]
# what each case's output must differ from, so that the equality is about the case's node
WITHOUT = {"differential_diffusion": "soft_latent_noise_mask"}
DENOISE = {"latent_noise_mask": 0.7, "differential_diffusion": 0.7, "soft_latent_noise_mask": 0.7}


def _sampler(cls, model, pos, neg, latent, denoise=1.0):
    inputs = {"seed": SEED, "steps": STEPS, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
              "denoise": denoise, "model": model, "positive": pos, "negative": neg, "latent_image": latent}
    if cls == "SDAccelKSampler":
        inputs.update(fused_kernels=False, cuda_graph=True, channels_last=True)
    return {"class_type": cls, "inputs": inputs}


_posted = itertools.count()


def _save_latent(graph, node, prefix):
    # a prefix of its own per prompt: ComfyUI does not run again an output node whose inputs it has cached
    prefix = "latents/cond_%s_%d" % (prefix, next(_posted))
    graph["90"] = {"class_type": "SaveLatent", "inputs": {"filename_prefix": prefix, "samples": node}}
    return graph


def _latent(srv, graph):
    entry = srv.run(graph)
    saved = entry["outputs"]["90"]["latents"][0]
    assert srv.proc.poll() is None, srv.log_tail()
    return load_file(os.path.join(srv.output_dir, saved.get("subfolder", ""), saved["filename"]))["latent_tensor"]


def _conditioning_graph(ckpt, case, sampler, denoise):
    g = _base(ckpt)
    nodes, model, pos, neg, latent = _conditioning(case)
    g.update(nodes)
    g["3"] = _sampler(sampler, model, pos, neg, latent, denoise)
    return _save_latent(g, ["3", 0], "%s_%s" % (case, sampler))


def _require(comfy, classes):
    info = comfy.object_info()
    missing = [c for c in classes if c not in info]
    assert not missing, "this ComfyUI has no %s" % missing   # every one is in ComfyUI 2024 and later


@pytest.mark.parametrize("case", CASES)
def test_conditioning_node_accelerated_equals_stock(comfy, models, case):
    nodes = _conditioning(case)[0]
    _require(comfy, {n["class_type"] for n in nodes.values()} | {"SolidMask", "MaskComposite"})
    denoise = DENOISE.get(case, 1.0)
    stock = _latent(comfy, _conditioning_graph(models["sd15"], case, "KSampler", denoise))
    ours = _latent(comfy, _conditioning_graph(models["sd15"], case, "SDAccelKSampler", denoise))
    without = WITHOUT.get(case, "plain")
    plain = _latent(comfy, _conditioning_graph(models["sd15"], without, "KSampler", denoise))
    assert not np.array_equal(stock, plain), "%s did not change the output against %s" % (case, without)
    assert np.array_equal(ours, stock), (case, float(np.abs(ours - stock).max()))


def _hires_graph(ckpt, sampler):
    g = _base(ckpt)
    g["3"] = _sampler(sampler, ["4", 0], ["6", 0], ["7", 0], ["5", 0])
    g["60"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["3", 0], "upscale_method": "bicubic",
                                                          "scale_by": 1.5}}
    g["61"] = _sampler(sampler, ["4", 0], ["6", 0], ["7", 0], ["60", 0], denoise=0.55)
    return _save_latent(g, ["61", 0], "hires_" + sampler)


def test_hires_fix_accelerated_equals_stock(comfy, models):
    """Two samplers in one prompt at two resolutions (the second on the upscaled latent at partial denoise)."""
    stock = _latent(comfy, _hires_graph(models["sd15"], "KSampler"))
    ours = _latent(comfy, _hires_graph(models["sd15"], "SDAccelKSampler"))
    assert stock.shape[-1] == SIZE // 8 * 3 // 2
    assert np.array_equal(ours, stock), float(np.abs(ours - stock).max())


def _split_graph(ckpt, accelerated, second_half=True):
    g = _base(ckpt)
    model = ["4", 0]
    if accelerated:
        g["70"] = {"class_type": "SDAccelApply", "inputs": {"model": model, "fused_kernels": False,
                                                            "cuda_graph": True, "channels_last": True}}
        model = ["70", 0]
    common = {"noise_seed": SEED, "steps": 6, "cfg": 7.0, "sampler_name": "dpmpp_2m", "scheduler": "karras",
              "model": model, "positive": ["6", 0], "negative": ["7", 0]}
    g["71"] = {"class_type": "KSamplerAdvanced", "inputs": dict(
        common, add_noise="enable", latent_image=["5", 0], start_at_step=0, end_at_step=3,
        return_with_leftover_noise="enable")}
    if not second_half:
        return _save_latent(g, ["71", 0], "split_first_half")
    g["72"] = {"class_type": "KSamplerAdvanced", "inputs": dict(
        common, add_noise="disable", latent_image=["71", 0], start_at_step=3, end_at_step=10000,
        return_with_leftover_noise="disable")}
    return _save_latent(g, ["72", 0], "split_%s" % ("ours" if accelerated else "stock"))


def test_split_schedule_on_an_apply_sd_accel_model_equals_stock(comfy, models):
    """KSamplerAdvanced steps 0-3 with leftover noise, then 3-6 without adding noise, on Apply SD Accel's model."""
    stock = _latent(comfy, _split_graph(models["sd15"], accelerated=False))
    ours = _latent(comfy, _split_graph(models["sd15"], accelerated=True))
    first_half = _latent(comfy, _split_graph(models["sd15"], accelerated=False, second_half=False))
    assert not np.array_equal(stock, first_half)
    assert np.array_equal(ours, stock), float(np.abs(ours - stock).max())
