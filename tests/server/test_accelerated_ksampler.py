"""Accelerated KSampler through the real server: stock's image, reports, LoRA."""
from workflow_util import psnr, run_image, txt2img

OFF = dict(fused_kernels=False, cuda_graph=False, channels_last=False)


def _ckpt(models):
    return models["sd15"]


def test_all_options_off_is_byte_identical_to_ksampler(comfy, models):
    stock, _ = run_image(comfy, txt2img(_ckpt(models), "KSampler", seed=11, prefix="stock_off"))
    ours, entry = run_image(comfy, txt2img(_ckpt(models), seed=11, prefix="ours_off", **OFF))
    assert (stock == ours).all()
    report = entry["outputs"]["3"]["sdaccel_report"][0]
    assert report["fell_back"]["fused_kernels"] == "off"
    assert not report["ran"]


def test_accelerated_matches_stock_and_reports_fused_kernels(comfy, models):
    stock, _ = run_image(comfy, txt2img(_ckpt(models), "KSampler", seed=12, prefix="stock_on"))
    ours, entry = run_image(comfy, txt2img(_ckpt(models), seed=12, prefix="ours_on"))
    assert psnr(stock, ours) >= 40, psnr(stock, ours)
    out = entry["outputs"]["3"]
    report = out["sdaccel_report"][0]
    ran = " ".join(report["ran"])
    # on this CPU machine the server runs Triton interpreted: the fused kernels really ran
    for op in ("group_norm_silu", "group_norm", "layer_norm", "geglu"):
        assert op + " x" in ran, (op, report)
    assert "cuda_graph" in report["fell_back"] and "CUDA" in report["fell_back"]["cuda_graph"]
    assert report["it_s"] > 0 and report["seconds"] > 0 and report["steps"] == 2
    assert out["text"][0].startswith("%.2f it/s" % report["it_s"])
    assert "[SD Accel]" in comfy.log_text()


def test_a_different_seed_changes_the_image(comfy, models):
    a, _ = run_image(comfy, txt2img(_ckpt(models), seed=21, prefix="seed_a", **OFF))
    b, _ = run_image(comfy, txt2img(_ckpt(models), seed=22, prefix="seed_b", **OFF))
    assert psnr(a, b) < 30


def test_lora_changes_output_exactly_as_stock(comfy, models):
    # one step: what is checked (the LoRA and each change of its strength reach the fused modules) shows in the first
    # step's output, and each accelerated prompt here runs its kernels in Triton's interpreter (tens of seconds a step)
    lora = models["lora15"]
    base, _ = run_image(comfy, txt2img(_ckpt(models), seed=31, steps=1, prefix="lora_base"))
    results = {}
    for strength in (1.0, -1.5):
        stock, _ = run_image(comfy, txt2img(_ckpt(models), "KSampler", seed=31, steps=1, prefix="lora_s",
                                            lora=(lora, strength)))
        ours, _ = run_image(comfy, txt2img(_ckpt(models), seed=31, steps=1, prefix="lora_o",
                                           lora=(lora, strength)))
        assert psnr(stock, ours) >= 40, (strength, psnr(stock, ours))
        assert psnr(base, ours) < 35, "the LoRA did not change the accelerated output"
        results[strength] = ours
    assert psnr(results[1.0], results[-1.5]) < 35, "changing the LoRA strength did not change the output"
