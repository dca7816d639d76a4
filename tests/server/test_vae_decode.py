"""VAE Decode (SD Accel) through the real ComfyUI server (CPU): with room it decodes whole and gives VAE
Decode's image exactly; under a budget too small for the whole decode it decodes in planned tiles (same
image size, reported); below the smallest tile it fails the prompt naming the minimum. The pack's VAE nodes in
one graph (decode, encode, decode again) give stock's image byte for byte on the CPU, where the VAE runs its own
modules and each node's report says so; so does stock VAE Decode / VAE Encode fed by Apply SD Accel (VAE)."""
import re

from workflow_util import psnr, run_image, txt2img


def _ours(wf, budget):
    wf["8"]["class_type"] = "SDAccelVAEDecode"
    wf["8"]["inputs"]["budget_gib"] = budget
    wf["5"]["inputs"].update(width=256, height=256)   # a 32x32 latent: room for 16 px tiles
    return wf


def _stock(models, prefix):
    wf = txt2img(models["sd15"], sampler="KSampler", seed=31, prefix=prefix)
    wf["5"]["inputs"].update(width=256, height=256)
    return wf


def test_whole_decode_is_vae_decode_and_tiles_under_a_small_budget(comfy, models):
    stock, _ = run_image(comfy, _stock(models, "vae_stock"))
    img, entry = run_image(comfy, _ours(_stock(models, "vae_whole"), 0.0))
    assert psnr(img, stock) == 99.0
    (ui,) = entry["outputs"]["8"]["sdaccel_memory"]
    assert ui["mode"] == "whole" and any("no VRAM budget" in n for n in ui["notes"])
    assert "cache released" in ui["notes"], "released after decoding by default"
    kept = _ours(_stock(models, "vae_kept"), 0.0)
    kept["8"]["inputs"]["release_cache"] = "never"
    img_kept, entry = run_image(comfy, kept)
    assert psnr(img_kept, stock) == 99.0 and "cache released" not in entry["outputs"]["8"]["sdaccel_memory"][0]["notes"]

    failed = comfy.run(_ours(_stock(models, "vae_tiny"), 0.0001), expect_success=False)
    text = str(failed.get("status"))
    assert "VAE Decode (SD Accel)" in text and "at least" in text
    floor = float(re.search(r"at least ([0-9.]+) GiB", text).group(1))

    img, entry = run_image(comfy, _ours(_stock(models, "vae_tiled"), floor + 0.01))
    (ui,) = entry["outputs"]["8"]["sdaccel_memory"]
    (line,) = entry["outputs"]["8"]["text"]
    assert ui["mode"] == "tiled" and 128 <= ui["tile_px"] < 256, ui
    assert img.shape == stock.shape and "VAE decode tiled" in line
    assert psnr(img, stock) > 15, "tiles of the same decoder: the same picture up to seams"


def _round_trip(models, variant, offset):
    """txt2img, decode, encode, decode: stock nodes, ours, or stock ones on Apply SD Accel (VAE)'s copy. Node ids
    are shifted per variant: ComfyUI 2024 caches outputs by node id, and its encode samples the latent from the
    global generator, so every node runs again (the sampler seeds that generator) and the encodes draw alike."""
    wf = _stock(models, "vae_rt_" + variant)
    wf["5"]["inputs"].update(width=64, height=64)
    wf["10"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["8", 0], "vae": ["4", 2]}}
    wf["11"] = {"class_type": "VAEDecode", "inputs": {"samples": ["10", 0], "vae": ["4", 2]}}
    wf["9"]["inputs"]["images"] = ["11", 0]
    if variant == "ours":
        for n, cls in (("8", "SDAccelVAEDecode"), ("10", "SDAccelVAEEncode"), ("11", "SDAccelVAEDecode")):
            wf[n]["class_type"] = cls
        wf["8"]["inputs"]["budget_gib"] = wf["11"]["inputs"]["budget_gib"] = 0.0
    elif variant == "applied":
        wf["12"] = {"class_type": "SDAccelApplyVAE", "inputs": {"vae": ["4", 2], "fused_kernels": True,
                                                               "cuda_graph": True, "channels_last": True}}
        for n in ("8", "10", "11"):
            wf[n]["inputs"]["vae"] = ["12", 0]
    return _shifted(wf, offset)


def _shifted(wf, offset):
    def ref(v):
        return [str(int(v[0]) + offset), v[1]] if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) else v
    return {str(int(k) + offset): dict(n, inputs={k2: ref(v) for k2, v in n["inputs"].items()}) for k, n in wf.items()}


def test_the_pack_s_vae_nodes_give_stock_s_image_byte_for_byte_on_the_cpu(comfy, models):
    stock, _ = run_image(comfy, _round_trip(models, "stock", 100))
    ours, entry = run_image(comfy, _round_trip(models, "ours", 200))
    applied, applied_entry = run_image(comfy, _round_trip(models, "applied", 300))
    assert psnr(ours, stock) == 99.0 and psnr(applied, stock) == 99.0
    for node in ("208", "210", "211"):
        (line,) = entry["outputs"][node]["text"]
        assert "ran: stock modules only" in line and "VAE on cpu: its own modules run" in line, (node, line)
    (line,) = applied_entry["outputs"]["312"]["text"]
    assert "patched: nothing" in line and "VAE on cpu" in line
