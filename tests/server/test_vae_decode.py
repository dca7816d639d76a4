"""VAE Decode (SD Accel) through the real ComfyUI server (CPU): with room it decodes whole and gives VAE
Decode's image exactly; under a budget too small for the whole decode it decodes in planned tiles (same
image size, reported); below the smallest tile it fails the prompt naming the minimum."""
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
