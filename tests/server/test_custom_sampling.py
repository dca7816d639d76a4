"""ComfyUI's custom sampling nodes on an Apply SD Accel model, through the real server.

SamplerCustom (a sampler object, sigmas from a scheduler node, cut by SplitSigmas: a second-pass schedule starting
mid-way) and, on current ComfyUI, SamplerCustomAdvanced with its guiders: CFGGuider, DualCFGGuider (three conds in
one batch), PerpNegGuider (an empty cond beside the two) and BasicGuider (no negative). Each graph runs stock (the
checkpoint's model) and again on Apply SD Accel's model, same seed: the latents must be equal. Apply SD Accel with
fused kernels off: on this CPU no graph runs, so this is SD Accel's step wrapper and guards around each guider's
calls, where any difference at all is a bug. tests/gpu/test_workflows_gpu.py runs them with graphs.

ComfyUI 2024 has SamplerCustom but none of the guiders: those cases are skipped there, and fail on any other
ComfyUI that lacks them.
"""
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

SIZE, SEED = 64, 13
APPLY = {"fused_kernels": False, "cuda_graph": True, "channels_last": True}


def _base(ckpt):
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red bicycle by a canal", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "11": {"class_type": "CLIPTextEncode", "inputs": {"text": "in the snow", "clip": ["4", 1]}},
        "12": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "20": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "dpmpp_2m"}},
    }


def _model(g, ours):
    if not ours:
        return ["4", 0]
    g["30"] = {"class_type": "SDAccelApply", "inputs": dict(APPLY, model=["4", 0])}
    return ["30", 0]


def _save(g, sampler_node, prefix):
    g["10"] = {"class_type": "SaveLatent", "inputs": {"filename_prefix": "latents/" + prefix,
                                                      "samples": [sampler_node, 0]}}
    return g


def sampler_custom(ckpt, ours):
    """A second pass's schedule: Karras sigmas for 6 steps, the last 3 (SplitSigmas at 3)."""
    g = _base(ckpt)
    g["21"] = {"class_type": "KarrasScheduler", "inputs": {"steps": 6, "sigma_max": 14.6, "sigma_min": 0.03,
                                                          "rho": 7.0}}
    g["22"] = {"class_type": "SplitSigmas", "inputs": {"sigmas": ["21", 0], "step": 3}}
    g["3"] = {"class_type": "SamplerCustom", "inputs": {
        "model": _model(g, ours), "add_noise": True, "noise_seed": SEED, "cfg": 6.0, "positive": ["6", 0],
        "negative": ["7", 0], "sampler": ["20", 0], "sigmas": ["22", 1], "latent_image": ["5", 0]}}
    return _save(g, "3", "custom_%s" % ("ours" if ours else "stock"))


GUIDERS = {
    "CFGGuider": lambda m: {"model": m, "positive": ["6", 0], "negative": ["7", 0], "cfg": 6.0},
    "DualCFGGuider": lambda m: {"model": m, "cond1": ["6", 0], "cond2": ["11", 0], "negative": ["7", 0],
                                "cfg_conds": 6.0, "cfg_cond2_negative": 3.0, "style": "regular"},
    "PerpNegGuider": lambda m: {"model": m, "positive": ["6", 0], "negative": ["7", 0], "empty_conditioning": ["12", 0],
                                "cfg": 6.0, "neg_scale": 1.5},
    "BasicGuider": lambda m: {"model": m, "conditioning": ["6", 0]},
}


def sampler_custom_advanced(ckpt, guider, ours):
    g = _base(ckpt)
    model = _model(g, ours)
    g["23"] = {"class_type": "BasicScheduler", "inputs": {"model": model, "scheduler": "karras", "steps": 3,
                                                         "denoise": 1.0}}
    g["24"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": SEED}}
    g["25"] = {"class_type": guider, "inputs": GUIDERS[guider](model)}
    g["3"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
        "noise": ["24", 0], "guider": ["25", 0], "sampler": ["20", 0], "sigmas": ["23", 0], "latent_image": ["5", 0]}}
    return _save(g, "3", "advanced_%s_%s" % (guider, "ours" if ours else "stock"))


def _latent(srv, graph):
    entry = srv.run(graph)
    saved = entry["outputs"]["10"]["latents"][0]
    return load_file(os.path.join(srv.output_dir, saved.get("subfolder", ""), saved["filename"]))["latent_tensor"]


def _require(srv, *classes):
    info = srv.object_info()
    missing = [c for c in classes if c not in info]
    if missing:
        if not srv.get("/system_stats").get("system", {}).get("comfyui_version"):
            pytest.skip("ComfyUI 2024 has no %s (not in its /object_info)" % ", ".join(missing))
        pytest.fail("this ComfyUI has no %s in /object_info" % ", ".join(missing))


def _assert_equal(srv, stock, ours, what):
    assert srv.proc.poll() is None, srv.log_tail()
    assert np.isfinite(stock).all(), (what, "stock's latent is not finite")
    diff = float(np.abs(ours - stock).max())
    assert diff == 0.0, (what, "latent max abs diff %.3g" % diff)


def test_sampler_custom_on_a_split_schedule_is_stock(comfy, models):
    _require(comfy, "SamplerCustom", "KarrasScheduler", "SplitSigmas", "KSamplerSelect")
    stock = _latent(comfy, sampler_custom(models["sd15"], False))
    _assert_equal(comfy, stock, _latent(comfy, sampler_custom(models["sd15"], True)), "SamplerCustom")


@pytest.mark.parametrize("guider", list(GUIDERS))
def test_sampler_custom_advanced_with_each_guider_is_stock(comfy, models, guider):
    _require(comfy, "SamplerCustomAdvanced", "RandomNoise", "BasicScheduler", guider)
    stock = _latent(comfy, sampler_custom_advanced(models["sd15"], guider, False))
    ours = _latent(comfy, sampler_custom_advanced(models["sd15"], guider, True))
    _assert_equal(comfy, stock, ours, guider)
