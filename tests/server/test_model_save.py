"""Saving a model SD Accel was applied to, through the real server: a merge workflow samples a preview of the merged
model and saves it. CheckpointSave loads the model (ComfyUI applies its object patches, SD Accel's stand-ins among
them) and writes its state dict: the file must hold the same tensors under the same names as stock's save of the
same merge without SD Accel. The `comfy_packs` server installs the fused stand-ins on the CPU as on a GPU (their
torch references run), so the saved tree is the one a GPU user's save reads.
"""
import os

from safetensors.torch import load_file


def _graph(models, accelerated, prefix):
    g = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": models["sd15"]}},
        "30": {"class_type": "UNETLoader", "inputs": {"unet_name": models["unet15_small"]}},
        "20": {"class_type": "ModelMergeSimple", "inputs": {"model1": ["4", 0], "model2": ["30", 0], "ratio": 0.6}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse", "clip": ["4", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    }
    model = ["20", 0]
    if accelerated:
        g["21"] = {"class_type": "SDAccelApply", "inputs": {"model": model, "fused_kernels": True, "cuda_graph": True,
                                                            "channels_last": True}}
        model = ["21", 0]
    g["3"] = {"class_type": "KSampler", "inputs": {
        "seed": 2, "steps": 1, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
        "model": model, "positive": ["6", 0], "negative": ["6", 0], "latent_image": ["5", 0]}}
    g["10"] = {"class_type": "SaveLatent", "inputs": {"filename_prefix": "latents/" + prefix, "samples": ["3", 0]}}
    g["40"] = {"class_type": "CheckpointSave", "inputs": {"model": model, "clip": ["4", 1], "vae": ["4", 2],
                                                          "filename_prefix": "checkpoints/" + prefix}}
    return g


def _saved(srv, entry, prefix):
    folder = os.path.join(srv.output_dir, "checkpoints")
    found = sorted(f for f in os.listdir(folder) if f.startswith(prefix) and f.endswith(".safetensors"))
    assert len(found) == 1, (found, entry["outputs"])
    return load_file(os.path.join(folder, found[0]))


def _with_defaults(srv, g):
    if "weight_dtype" in srv.object_info()["UNETLoader"]["input"]["required"]:
        g["30"]["inputs"]["weight_dtype"] = "default"
    return g


def test_checkpoint_save_of_an_accelerated_merge_writes_stock_s_tensors(comfy_packs, models):
    stock_entry = comfy_packs.run(_with_defaults(comfy_packs, _graph(models, False, "save_stock")))
    log_start = len(comfy_packs.log_text())
    ours_entry = comfy_packs.run(_with_defaults(comfy_packs, _graph(models, True, "save_ours")))
    log = comfy_packs.log_text()[log_start:]
    assert "[SD Accel] Apply: patched: " in log and "patched: nothing" not in log, log[-3000:]
    stock, ours = _saved(comfy_packs, stock_entry, "save_stock"), _saved(comfy_packs, ours_entry, "save_ours")
    assert sorted(ours) == sorted(stock), (sorted(set(ours) ^ set(stock)))[:20]
    differ = [k for k in stock if ours[k].dtype != stock[k].dtype or ours[k].shape != stock[k].shape
              or not bool((ours[k] == stock[k]).all())]
    assert not differ, differ[:20]
    unet = [k for k in stock if k.startswith("model.diffusion_model.")]
    assert len(unet) > 100, len(unet)
    assert comfy_packs.proc.poll() is None, comfy_packs.log_tail()

