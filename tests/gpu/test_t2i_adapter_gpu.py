"""A T2I adapter (ComfyUI's ControlNetLoader gives a T2IAdapter, applied with Apply ControlNet) under the Accelerated
KSampler with CUDA graphs, in process on the current ComfyUI. The adapter is not a full ControlNet: SD Accel leaves
it stock (the report says so), and its features reach the UNet's input blocks as the step's `control` input. It
places them by SD1.5's input blocks, so this test builds the full SD1.5 layout (random weights, dev/fixtures.py) and
a random adapter.

Stock KSampler, then ours twice (both within fp16 noise of stock, the second prompt replaying graphs without a new
capture), then another strength and another hint image: each equals stock for its own inputs, never a graph's
earlier features."""
import os

import pytest
import torch

from test_graphs_gpu import COMFY, WORK, _rel, comfy_env  # noqa: F401  (the shared module fixture)

SIZE, STEPS, TOL = 256, 6, 2e-2
MIN_EFFECT = TOL + 1e-2


@pytest.fixture(scope="module")
def sd15_and_adapter(comfy_env):  # noqa: F811
    import folder_paths
    import fixtures
    ck = os.path.join(WORK, "checkpoints", "gpu_sd15_full.safetensors")
    ad = os.path.join(WORK, "controlnet", "gpu_t2i_sd15.safetensors")
    fixtures.ensure(ck, fixtures.build_checkpoint, COMFY, "sd15", "sd15", ck, 8)
    fixtures.ensure(ad, fixtures.build_t2i_adapter, COMFY, ad, 9)
    folder_paths.add_model_folder_path("checkpoints", os.path.dirname(ck), is_default=True)
    folder_paths.add_model_folder_path("controlnet", os.path.dirname(ad), is_default=True)
    nodes = comfy_env.nodes
    with torch.inference_mode():
        model, clip = nodes.CheckpointLoaderSimple().load_checkpoint("gpu_sd15_full.safetensors")[:2]
        pos = nodes.CLIPTextEncode().encode(clip, "a lighthouse")[0]
        neg = nodes.CLIPTextEncode().encode(clip, "")[0]
        adapter = nodes.ControlNetLoader().load_controlnet("gpu_t2i_sd15.safetensors")[0]
    assert type(adapter).__name__ == "T2IAdapter", type(adapter)
    return model, pos, neg, adapter


def _hint(x):
    image = torch.zeros((1, SIZE, SIZE, 3))
    image[:, 64:192, x:x + 96, :] = 1.0
    return image


def _run(env, setup, strength=1.0, hint_x=40, ours=True, adapter=True):
    model, pos, neg, t2i = setup
    nodes = env.nodes
    with torch.inference_mode():
        if adapter:
            pos, neg = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, t2i, _hint(hint_x), strength, 0.0,
                                                                        1.0)[:2]
        lat = nodes.EmptyLatentImage().generate(SIZE, SIZE, 1)[0]
        args = (model, 5, STEPS, 7.0, "euler", "normal", pos, neg, lat)
        if ours:
            res = env.ours.sample(*args)
            return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]
        return nodes.KSampler().sample(*args)[0]["samples"].float(), None


def test_t2i_adapter_with_graphs_equals_stock_and_never_replays_earlier_features(comfy_env, sd15_and_adapter):  # noqa: F811
    plain, _ = _run(comfy_env, sd15_and_adapter, ours=False, adapter=False)
    ref, _ = _run(comfy_env, sd15_and_adapter, ours=False)
    assert torch.isfinite(ref).all() and _rel(ref, plain) > MIN_EFFECT, _rel(ref, plain)
    first, rep1 = _run(comfy_env, sd15_and_adapter)
    second, rep2 = _run(comfy_env, sd15_and_adapter)
    assert max(_rel(first, ref), _rel(second, ref)) < TOL, (_rel(first, ref), _rel(second, ref), rep2["graphs"])
    g = rep2["graphs"]
    assert g["replays"] >= 1 and g["captures"] == 0 and not g.get("refused"), g
    for kw in ({"strength": 0.5}, {"hint_x": 120}, {}):
        want, _ = _run(comfy_env, sd15_and_adapter, ours=False, **kw)
        assert kw == {} or _rel(want, ref) > MIN_EFFECT, (kw, _rel(want, ref))
        out, rep = _run(comfy_env, sd15_and_adapter, **kw)
        assert _rel(out, want) < TOL, (kw, _rel(out, want), rep["graphs"])
