"""VRAM Pool through the real ComfyUI server (CPU): the shipped txt2img workflow with the pool between the
checkpoint and a stock KSampler gives the same image as without it, for each offload mode; the node's UI
output (what the frontend shows) carries the plan and says what could not run here; a budget below the
model's minimum fails the prompt with the minimum named."""
import pytest

from workflow_util import run_image, psnr, txt2img


def _with_pool(wf, **inputs):
    wf["20"] = {"class_type": "SDAccelVRAMPool",
                "inputs": dict({"model": wf["3"]["inputs"]["model"], "budget_gib": 8.0, "offload": "none",
                                "release_cache": "after_run", "expandable_segments": False}, **inputs)}
    wf["3"]["inputs"]["model"] = ["20", 0]
    return wf


@pytest.fixture(scope="module")
def stock(comfy, models):
    img, _ = run_image(comfy, txt2img(models["sd15"], sampler="KSampler", seed=21, prefix="pool_stock"))
    return img


@pytest.mark.parametrize("offload", ["none", "medvram", "lowvram"])
def test_pool_gives_the_stock_image(comfy, models, stock, offload):
    wf = _with_pool(txt2img(models["sd15"], sampler="KSampler", seed=21, prefix="pool_" + offload), offload=offload)
    img, entry = run_image(comfy, wf)
    assert psnr(img, stock) == 99.0, "the pool must not change the image"
    out = entry["outputs"]["20"]
    (ui,) = out["sdaccel_memory"]
    (line,) = out["text"]
    assert ui["offload"] == offload and ui["resident_count"] >= 1 and "blocks resident" in line
    if offload == "lowvram":
        assert ui["streaming"] is False           # a CPU server: said, and run as offload=none
        assert "lowvram: block streaming off" in line
    log = comfy.log_text()
    assert "[SD Accel] VRAM Pool:" in log


def test_budget_below_the_minimum_fails_the_prompt_clearly(comfy, models):
    wf = _with_pool(txt2img(models["sd15"], sampler="KSampler", seed=21, prefix="pool_small"), budget_gib=0.25)
    entry = comfy.run(wf, expect_success=False)
    text = str(entry.get("status"))
    assert "VRAM budget 0.25 GiB is too small" in text and "budget_gib" in text
