"""SDXL with CUDA graphs, in process on the current ComfyUI: a random full-size SDXL checkpoint (dev/fixtures.py; its
two text encoders too), 512 px (SDXL runs any size; the step's shapes are what a graph keys on), euler.

Stock KSampler, then the Accelerated KSampler twice: within fp16 noise of stock, the second prompt replaying graphs
without a new capture. Then what SDXL adds to SD1.5's step: the `y` vector (pooled text embedding and the size and
crop conditioning of CLIPTextEncodeSDXL). Prompts that differ only in the size conditioning reach the step as the
same shapes with another `y`: each must equal stock for its own `y`, never a graph's earlier one. And a second
resolution and batch size: a graph each, the first still replaying."""
import importlib
import os

import pytest
import torch

from test_graphs_gpu import COMFY, WORK, _rel, comfy_env  # noqa: F401  (the shared module fixture)

STEPS, TOL = 4, 2e-2
MIN_EFFECT = TOL + 1e-2


@pytest.fixture(scope="module")
def sdxl(comfy_env):  # noqa: F811
    import folder_paths
    import fixtures
    ck = os.path.join(WORK, "checkpoints", "gpu_sdxl.safetensors")
    fixtures.ensure(ck, fixtures.build_checkpoint, COMFY, "sdxl", "full", ck, 11)
    folder_paths.add_model_folder_path("checkpoints", os.path.dirname(ck), is_default=True)
    with torch.inference_mode():
        model, clip = comfy_env.nodes.CheckpointLoaderSimple().load_checkpoint("gpu_sdxl.safetensors")[:2]
    assert type(model.model).__name__ == "SDXL", type(model.model)
    return model, clip


def _encode(clip, text, size=1024, crop=0, target=1024):
    node = importlib.import_module("comfy_extras.nodes_clip_sdxl").CLIPTextEncodeSDXL
    with torch.inference_mode():
        return node.execute(clip=clip, width=size, height=size, crop_w=crop, crop_h=crop, target_width=target,
                            target_height=target, text_g=text, text_l=text)[0]


def _run(env, model, pos, neg, side=512, batch=1, ours=True):
    with torch.inference_mode():
        lat = env.nodes.EmptyLatentImage().generate(side, side, batch)[0]
        args = (model, 7, STEPS, 6.0, "euler", "normal", pos, neg, lat)
        if ours:
            res = env.ours.sample(*args)
            return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]
        return env.nodes.KSampler().sample(*args)[0]["samples"].float(), None


def test_sdxl_equals_stock_and_a_new_size_conditioning_never_replays_the_old_one(comfy_env, sdxl):  # noqa: F811
    model, clip = sdxl
    neg = _encode(clip, "blurry")
    conds = {"1024": _encode(clip, "a lighthouse"),
             "crop": _encode(clip, "a lighthouse", crop=256),
             "small": _encode(clip, "a lighthouse", size=512, target=512)}
    refs = {k: _run(comfy_env, model, c, neg, ours=False)[0] for k, c in conds.items()}
    assert all(torch.isfinite(r).all() for r in refs.values())
    assert _rel(refs["crop"], refs["1024"]) > MIN_EFFECT and _rel(refs["small"], refs["1024"]) > MIN_EFFECT, (
        "the size conditioning moves a random SDXL's latent too little to test",
        _rel(refs["crop"], refs["1024"]), _rel(refs["small"], refs["1024"]))
    first, _ = _run(comfy_env, model, conds["1024"], neg)
    second, rep = _run(comfy_env, model, conds["1024"], neg)
    assert max(_rel(first, refs["1024"]), _rel(second, refs["1024"])) < TOL, (
        _rel(first, refs["1024"]), _rel(second, refs["1024"]), rep["graphs"])
    g = rep["graphs"]
    assert g["replays"] >= 1 and g["captures"] == 0 and not g.get("refused"), g
    for key in ("crop", "small", "1024", "crop"):
        out, rep = _run(comfy_env, model, conds[key], neg)
        assert _rel(out, refs[key]) < TOL, (key, _rel(out, refs[key]), rep["graphs"])
        assert rep["graphs"]["captures"] == 0, ("only y changed: the same graph, new inputs", key, rep["graphs"])


def test_sdxl_another_resolution_and_batch_get_their_own_graphs(comfy_env, sdxl):  # noqa: F811
    model, clip = sdxl
    pos, neg = _encode(clip, "a red bicycle"), _encode(clip, "")
    for side, batch in ((768, 1), (512, 2), (512, 1)):
        ref, _ = _run(comfy_env, model, pos, neg, side, batch, ours=False)
        _run(comfy_env, model, pos, neg, side, batch)
        out, rep = _run(comfy_env, model, pos, neg, side, batch)
        assert _rel(out, ref) < TOL, (side, batch, _rel(out, ref), rep["graphs"])
        assert rep["graphs"]["replays"] >= 1 and rep["graphs"]["captures"] == 0, (side, batch, rep["graphs"])
