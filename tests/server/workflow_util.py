"""Shared helpers for the server tests: build prompts from the shipped workflows, read images."""
import json
import os

import comfy_server
import numpy as np
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKFLOWS = os.path.join(REPO, "workflows")
TXT2IMG = os.path.join(WORKFLOWS, "sd15_txt2img_accelerated.api.json")
SMALL = {"width": 64, "height": 64, "batch_size": 1}


def load_api(path):
    with open(path) as f:
        return json.load(f)


def txt2img(ckpt, sampler="SDAccelKSampler", seed=7, steps=2, prefix="t", lora=None, **accel):
    """The shipped txt2img workflow at test size; `sampler` swaps the sampling node's class."""
    wf = load_api(TXT2IMG)
    wf["4"]["inputs"]["ckpt_name"] = ckpt
    wf["5"]["inputs"].update(SMALL)
    node = wf["3"]
    node["class_type"] = sampler
    node["inputs"].update(seed=seed, steps=steps)
    if sampler == "KSampler":   # the stock graph: stock nodes only
        for k in ("fused_kernels", "cuda_graph", "channels_last"):
            node["inputs"].pop(k)
        comfy_server.without_node_class(wf, "SDAccelApplyCLIP")
    else:
        node["inputs"].update(accel)
    wf["9"]["inputs"]["filename_prefix"] = prefix
    if lora is not None:
        name, strength = lora
        wf["10"] = {"class_type": "LoraLoader", "inputs": {"lora_name": name, "strength_model": strength,
                                                           "strength_clip": 0.0, "model": ["4", 0],
                                                           "clip": ["4", 1]}}
        node["inputs"]["model"] = ["10", 0]
    return wf


def image(path):
    return np.asarray(Image.open(path).convert("RGB")).astype(np.float64)


def psnr(a, b):
    mse = float(((a - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def run_image(srv, wf):
    entry = srv.run(wf)
    paths = srv.output_images(entry)
    assert len(paths) == 1, entry.get("outputs")
    return image(paths[0]), entry
