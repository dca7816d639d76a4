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
    """The pool never changes the image, at every offload level. On this CPU server lowvram's block streaming
    cannot run: what the lowvram case proves is that it falls back to offload=none and says so in the report;
    the streaming itself is proven on a GPU (tests/gpu/test_lowvram_graphs_gpu.py, test_pinned_memory_gpu.py)."""
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


def test_text_encode_through_the_pool_and_its_report_in_the_accelerated_ksampler(comfy, models):
    """The checkpoint's CLIP through the pool's clip input: the text encoders take the pool's clip output, the
    Accelerated KSampler samples the pooled model. Same image as the Accelerated KSampler without the pool; on
    a ComfyUI that can apply the pool, the sampler's report (what the frontend's badge shows) carries the pool's
    stages, text encode first. Without the fused kernels (what is checked is the text encode and the report; the
    kernels, interpreted on the CPU, would make each prompt take a minute)."""
    plain, _ = run_image(comfy, txt2img(models["sd15"], sampler="SDAccelKSampler", seed=21, prefix="pool_noclip",
                                        fused_kernels=False))
    wf = _with_pool(txt2img(models["sd15"], sampler="SDAccelKSampler", seed=21, prefix="pool_clip",
                            fused_kernels=False))
    wf["20"]["inputs"]["clip"] = ["4", 1]
    for k in ("6", "7"):
        wf[k]["inputs"]["clip"] = ["20", 1]
    img, entry = run_image(comfy, wf)
    assert psnr(img, plain) == 99.0, "the pool's text encode must not change the image"
    (ui,) = entry["outputs"]["20"]["sdaccel_memory"]
    (line,) = entry["outputs"]["20"]["text"]
    assert ui["clip"] is True
    (report,) = entry["outputs"]["3"]["sdaccel_report"]
    if ui["enforced"]:
        assert "clip: text encode under the pool" in line
        assert [s["stage"] for s in report["memory"]["stages"]] == ["text encode", "sampling"]
        assert any(n.startswith("VRAM Pool: memory: text encode") for n in report["notes"]), report["notes"]
    else:                      # ComfyUI 2024: no keyed wrappers, the CLIP is passed through unchanged
        assert "clip: passed through" in line and "memory" not in report
