"""ComfyUI's model merge nodes between the loaders and the sampler, through the real server.

A merge node clones its first model and adds the second model's weights to it as weight patches
(`add_patches` with the other model's tensors, each with its own strengths), applied when the merged model
loads: the same mechanism as a LoRA, with every weight of the UNet patched and the patch a whole tensor. Users
merge two checkpoints (here the checkpoint's UNet and a second UNet of the same layout with other weights, from
UNETLoader), by block, by difference, and put a LoRA on the result.

For each merge: the Accelerated KSampler's latent equals stock KSampler's (to the bit with fused kernels off,
where on this CPU machine ComfyUI's own modules run through our step; within fp32 rounding with them on, the
kernels interpreted), and the merge changed the output against the checkpoint alone. Changing the ratio in one
server process runs the new weights, never the earlier ones (on a GPU, tests/gpu/test_model_merge_gpu.py checks
that no CUDA graph replays the earlier ratio's weights). In the shared server, after the other graphs: a merge
that left its weights in SD Accel's stand-ins made later graphs there, stock's too, come out wrong
(tests/hosts/comfyui/test_merge_beside_our_stand_ins.py).
"""
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from workflow_util import image, psnr

SEED, STEPS, SIZE = 5, 3, 64
POSITIVE, NEGATIVE = "a lighthouse on a cliff at dusk", "blurry"
# (node, its inputs besides model1 and model2); ModelMergeSD1's per-block inputs are filled from /object_info
MERGES = {
    "ModelMergeSimple": ("ModelMergeSimple", {"ratio": 0.6}),
    "ModelMergeBlocks": ("ModelMergeBlocks", {"input": 0.2, "middle": 0.7, "out": 0.5}),
    "ModelMergeSubtract": ("ModelMergeSubtract", {"multiplier": 0.3}),
    "ModelMergeAdd": ("ModelMergeAdd", {}),
    "ModelMergeSD1": ("ModelMergeSD1", {"input_blocks.1.": 0.3, "middle_block.1.": 0.0, "output_blocks.3.": 0.4,
                                        "out.": 0.5}),
}
LACKS_2024 = {"ModelMergeSD1"}


def _graph(models, sampler, merge=None, lora=None, fused=False, steps=STEPS, prefix="merge"):
    g = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": models["sd15"]}},
        "30": {"class_type": "UNETLoader", "inputs": {"unet_name": models["unet15_small"]}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": POSITIVE, "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": NEGATIVE, "clip": ["4", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
    }
    model = ["4", 0]
    if merge is not None:
        cls, inputs = merge
        g["20"] = {"class_type": cls, "inputs": dict(inputs, model1=model, model2=["30", 0])}
        model = ["20", 0]
    if lora is not None:
        g["21"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"lora_name": lora, "strength_model": 0.8,
                                                                   "model": model}}
        model = ["21", 0]
    inputs = {"seed": SEED, "steps": steps, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
              "denoise": 1.0, "model": model, "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}
    if sampler == "SDAccelKSampler":
        inputs.update(fused_kernels=fused, cuda_graph=True, channels_last=True)
    g["3"] = {"class_type": sampler, "inputs": inputs}
    g["8"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}}
    g["9"] = {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}}
    g["10"] = {"class_type": "SaveLatent", "inputs": {"filename_prefix": "latents/" + prefix, "samples": ["3", 0]}}
    return g


def _with_defaults(srv, g):
    """What each ComfyUI has and the graph does not set, at the node's default: UNETLoader's weight_dtype
    (current ComfyUI) and ModelMergeSD1's per-block ratios (this test sets a few)."""
    info = srv.object_info()
    for node in g.values():
        required = info[node["class_type"]]["input"]["required"]
        if node["class_type"] == "UNETLoader" and "weight_dtype" in required:
            node["inputs"].setdefault("weight_dtype", "default")
        if node["class_type"] == "ModelMergeSD1":
            for name, spec in required.items():
                if spec[0] == "FLOAT":
                    node["inputs"].setdefault(name, spec[1]["default"])
    return g


def _run(srv, g):
    entry = srv.run(_with_defaults(srv, g))
    out = entry["outputs"]
    images = srv.output_images(entry)
    assert len(images) == 1, out
    saved = out["10"]["latents"][0]
    latent = load_file(os.path.join(srv.output_dir, saved.get("subfolder", ""), saved["filename"]))["latent_tensor"]
    report = out.get("3", {}).get("sdaccel_report", [None])[0]
    if report is not None:
        assert not [n for n in report["notes"] if "accelerated run failed" in n], report["notes"]
    assert srv.proc.poll() is None, srv.log_tail()
    return {"image": image(images[0]), "latent": latent}


def _assert_same(stock, ours, fused, what):
    assert np.isfinite(stock["latent"]).all(), what
    if fused:
        rel = float(np.linalg.norm(ours["latent"] - stock["latent"]) / np.linalg.norm(stock["latent"]))
        assert rel < 1e-4, (what, "latent rel. error %.3g" % rel)
        assert psnr(stock["image"], ours["image"]) >= 40, (what, psnr(stock["image"], ours["image"]))
        return
    diff = float(np.abs(ours["latent"] - stock["latent"]).max())
    assert diff == 0.0, (what, "latent max abs diff %.3g" % diff)
    assert (ours["image"] == stock["image"]).all(), (what, psnr(stock["image"], ours["image"]))


def _require(srv, cls):
    info = srv.object_info()
    if cls in info:
        return
    version = srv.get("/system_stats").get("system", {}).get("comfyui_version") or "2024"
    if version == "2024" and cls in LACKS_2024:
        pytest.skip("ComfyUI 2024 has no %s (not in its /object_info)" % cls)
    pytest.fail("ComfyUI %s has no %s in /object_info" % (version, cls))


@pytest.fixture(scope="module")
def unmerged(comfy, models):
    """Stock KSampler on the checkpoint alone, once per step count."""
    done = {}

    def run(steps=STEPS):
        if steps not in done:
            done[steps] = _run(comfy, _graph(models, "KSampler", steps=steps, prefix="unmerged%d" % steps))
        return done[steps]
    return run


@pytest.mark.parametrize("case", list(MERGES))
def test_merged_model_accelerated_equals_stock(comfy, models, unmerged, case):
    merge = MERGES[case]
    _require(comfy, merge[0])
    stock = _run(comfy, _graph(models, "KSampler", merge, prefix=case + "_stock"))
    ours = _run(comfy, _graph(models, "SDAccelKSampler", merge, prefix=case + "_ours"))
    assert not np.array_equal(stock["latent"], unmerged()["latent"]), "%s did not change the output" % case
    _assert_same(stock, ours, False, case)


def test_lora_on_a_merged_model_accelerated_equals_stock(comfy, models, unmerged):
    """The LoRA's patches go on top of the merge's on the same weights (ComfyUI applies them in order)."""
    merge = MERGES["ModelMergeSimple"]
    stock = _run(comfy, _graph(models, "KSampler", merge, lora=models["lora15"], prefix="mergelora_stock"))
    merged = _run(comfy, _graph(models, "KSampler", merge, prefix="mergelora_merged"))
    ours = _run(comfy, _graph(models, "SDAccelKSampler", merge, lora=models["lora15"], prefix="mergelora_ours"))
    assert not np.array_equal(stock["latent"], merged["latent"]), "the LoRA did not change the merged output"
    _assert_same(stock, ours, False, "merge + LoRA")


def test_a_new_ratio_runs_the_new_weights(comfy, models):
    """0.6, 0.3, then 0.6 again through the Accelerated KSampler in one server: each equals stock at its ratio.
    A path that kept what it derived from the first ratio's weights would give 0.3 the 0.6 image."""
    ratios = (0.6, 0.3, 0.6)
    stock = {r: _run(comfy, _graph(models, "KSampler", ("ModelMergeSimple", {"ratio": r}), prefix="ratio_stock"))
             for r in set(ratios)}
    assert not np.array_equal(stock[0.6]["latent"], stock[0.3]["latent"])
    for r in ratios:
        ours = _run(comfy, _graph(models, "SDAccelKSampler", ("ModelMergeSimple", {"ratio": r}), prefix="ratio_ours"))
        _assert_same(stock[r], ours, False, "ratio %.1f" % r)


def test_merged_model_fused_kernels_equal_stock(comfy, models):
    """The fused modules read the merged weights (one step: the kernels run interpreted here)."""
    merge = MERGES["ModelMergeBlocks"]
    stock = _run(comfy, _graph(models, "KSampler", merge, steps=1, prefix="mergefused_stock"))
    ours = _run(comfy, _graph(models, "SDAccelKSampler", merge, fused=True, steps=1, prefix="mergefused_ours"))
    _assert_same(stock, ours, True, "ModelMergeBlocks fused")
