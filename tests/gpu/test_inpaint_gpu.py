"""An inpainting UNet (9 input channels) with CUDA graphs: dev/fixtures.py's UNet-only file at the `small` preset,
loaded with UNETLoader, the image and mask prepared by ComfyUI's InpaintModelConditioning (the mask and the masked
image's latent in the conditioning: the step's c_concat input) or VAE Encode (for Inpainting). Stock KSampler, then
the Accelerated KSampler twice: both within fp16 noise of stock, the second prompt replaying graphs without a new
capture. In process on the current ComfyUI, `comfy_env`'s CLIP and VAE."""
import os

import pytest
import torch

from test_graphs_gpu import COMFY, WORK, _rel, comfy_env  # noqa: F401  (the shared module fixture)

SIZE, TOL = 256, 2e-2


@pytest.fixture(scope="module")
def inpaint_unet(comfy_env):  # noqa: F811
    import folder_paths
    import fixtures
    folder = os.path.join(WORK, "diffusion_models")
    path = os.path.join(folder, "gpu_small_inpaint.safetensors")
    fixtures.ensure(path, fixtures.build_unet, COMFY, "small", path, 9, 6)
    folder_paths.add_model_folder_path("diffusion_models", folder, is_default=True)
    with torch.inference_mode():
        return comfy_env.nodes.UNETLoader().load_unet("gpu_small_inpaint.safetensors", "default")[0]


def _image_and_mask():
    image = torch.full((1, SIZE, SIZE, 3), 0.1)
    image[:, 140:220, 30:120, :] = 0.9
    mask = torch.zeros((1, SIZE, SIZE))
    mask[:, 130:230, 20:130] = 1.0
    return image, mask


def _prepared(env, prep):
    image, mask = _image_and_mask()
    with torch.inference_mode():
        if prep == "InpaintModelConditioning":
            return env.nodes.InpaintModelConditioning().encode(env.pos, env.neg, image, env.vae, mask, True)
        latent = env.nodes.VAEEncodeForInpaint().encode(env.vae, image, mask, 6)[0]
        return env.pos, env.neg, latent


def _run(env, model, pos, neg, latent, ours):
    with torch.inference_mode():
        args = (model, 5, 6, 7.0, "euler", "normal", pos, neg, latent)
        if ours:
            res = env.ours.sample(*args)
            return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]
        return env.nodes.KSampler().sample(*args)[0]["samples"].float(), None


@pytest.mark.parametrize("prep", ["InpaintModelConditioning", "VAEEncodeForInpaint"])
def test_inpainting_unet_with_graphs_equals_stock_and_reuses_its_graphs(comfy_env, inpaint_unet, prep):  # noqa: F811
    pos, neg, latent = _prepared(comfy_env, prep)
    stock, _ = _run(comfy_env, inpaint_unet, pos, neg, latent, ours=False)
    first, rep1 = _run(comfy_env, inpaint_unet, pos, neg, latent, ours=True)
    second, rep2 = _run(comfy_env, inpaint_unet, pos, neg, latent, ours=True)
    assert torch.isfinite(stock).all()
    assert max(_rel(first, stock), _rel(second, stock)) < TOL, (_rel(first, stock), _rel(second, stock))
    assert rep1["graphs"]["replays"] >= 1, rep1["graphs"]
    g = rep2["graphs"]
    assert g["replays"] >= 1 and g["captures"] == 0 and not g.get("refused"), g
