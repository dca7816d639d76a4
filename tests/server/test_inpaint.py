"""An inpainting UNet (9 input channels: the latent, the mask and the masked image's latent) through the real
server: UNETLoader -> KSampler, the image and mask prepared as users do with ComfyUI's own inpaint nodes
(VAE Encode (for Inpainting), or InpaintModelConditioning, which puts the mask and masked image into the
conditioning). The Accelerated KSampler's output must equal KSampler's: to the bit with fused kernels off, within
the fused modules' float noise with them on (TRITON_INTERPRET in this server). The extra channels come as the
step's c_concat input; a step that lost them would fail on the UNet's first convolution (9 input channels)."""
import numpy as np
import pytest
from workflow_util import image, psnr

SEED, STEPS = 5, 3
PROMPT, NEGATIVE = "a red brick wall", "blurry"


def _graph(models, sampler, prep, fused=False, prefix="inpaint"):
    """64 px: a dark image with a light 24x16 square off-centre, the square as the mask (its red channel)."""
    g = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": models["sd15"]}},
        "30": {"class_type": "UNETLoader", "inputs": {"unet_name": models["unet15inpaint_tiny"]}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": NEGATIVE, "clip": ["4", 1]}},
        "dark": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0x101010}},
        "light": {"class_type": "EmptyImage", "inputs": {"width": 24, "height": 16, "batch_size": 1,
                                                         "color": 0xF0E0C0}},
        "pixels": {"class_type": "ImageCompositeMasked", "inputs": {
            "destination": ["dark", 0], "source": ["light", 0], "x": 8, "y": 36, "resize_source": False}},
        "mask": {"class_type": "ImageToMask", "inputs": {"image": ["pixels", 0], "channel": "red"}},
    }
    pos, neg = ["6", 0], ["7", 0]
    if prep == "VAEEncodeForInpaint":
        g["enc"] = {"class_type": "VAEEncodeForInpaint", "inputs": {"pixels": ["pixels", 0], "vae": ["4", 2],
                                                                    "mask": ["mask", 0], "grow_mask_by": 6}}
        latent = ["enc", 0]
    else:
        g["enc"] = {"class_type": "InpaintModelConditioning", "inputs": {
            "positive": pos, "negative": neg, "vae": ["4", 2], "pixels": ["pixels", 0], "mask": ["mask", 0]}}
        pos, neg, latent = ["enc", 0], ["enc", 1], ["enc", 2]
    inputs = {"seed": SEED, "steps": STEPS, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
              "denoise": 1.0, "model": ["30", 0], "positive": pos, "negative": neg, "latent_image": latent}
    if sampler == "SDAccelKSampler":
        inputs.update(fused_kernels=fused, cuda_graph=True, channels_last=True)
    g["3"] = {"class_type": sampler, "inputs": inputs}
    g["8"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}}
    g["9"] = {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}}
    return g


def _fill_inputs(srv, g):
    """Node inputs each ComfyUI has and this graph does not set: UNETLoader's weight_dtype and
    InpaintModelConditioning's noise_mask (current ComfyUI), at their defaults."""
    info = srv.object_info()
    for node in g.values():
        required = info[node["class_type"]]["input"]["required"]
        if node["class_type"] == "UNETLoader" and "weight_dtype" in required:
            node["inputs"].setdefault("weight_dtype", "default")
        if node["class_type"] == "InpaintModelConditioning" and "noise_mask" in required:
            node["inputs"].setdefault("noise_mask", True)
    return g


def _run(srv, g):
    entry = srv.run(_fill_inputs(srv, g))
    paths = srv.output_images(entry)
    assert len(paths) == 1, entry["outputs"]
    report = entry["outputs"].get("3", {}).get("sdaccel_report", [None])[0]
    if report is not None:
        assert not [n for n in report["notes"] if "accelerated run failed" in n], report["notes"]
    return image(paths[0])


@pytest.mark.parametrize("prep", ["VAEEncodeForInpaint", "InpaintModelConditioning"])
@pytest.mark.parametrize("fused", [False, True], ids=["plumbing_exact", "fused"])
def test_inpainting_unet_accelerated_equals_stock(comfy, models, prep, fused):
    stock = _run(comfy, _graph(models, "KSampler", prep, prefix="inp_stock"))
    ours = _run(comfy, _graph(models, "SDAccelKSampler", prep, fused=fused, prefix="inp_ours"))
    if fused:
        assert psnr(stock, ours) >= 40, psnr(stock, ours)
    else:
        assert np.array_equal(stock, ours), psnr(stock, ours)
    assert comfy.proc.poll() is None, comfy.log_tail()
