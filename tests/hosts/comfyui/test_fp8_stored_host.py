"""A checkpoint loaded with fp8 weights (what UNETLoader's weight_dtype fp8_e4m3fn does), through real ComfyUI in
process (CPU), with the nodes' `fp8_weights` choice: "fp16 copies" (the default) plans one kept fp16 copy per
fp8-stored Linear/Conv2d and makes them on the first step; "as stored" plans none and makes none (the UNet's weights
stay in fp8, in half an fp16 model's memory), and says so. Both give stock's latent bit for bit.

The copies are planned only for a model that loads on a GPU: the check is forced here, as
tests/hosts/comfyui/test_other_packs_inproc.py does for the channels_last stand-ins. ComfyUI 2024 cannot load
weights as fp8 (no weight dtype in its loaders), so there is no fp8-stored model to meet there: skipped.
"""
import pytest
import torch

import comfy_inproc


def _fp8_model(folder):
    path = comfy_inproc.tiny_checkpoint(folder)
    import comfy.sd
    if "model_options" not in comfy.sd.load_checkpoint_guess_config.__code__.co_varnames:
        pytest.skip("this ComfyUI (2024) cannot load weights as fp8: no fp8-stored model exists there")
    with torch.inference_mode():
        return comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False,
                                                     model_options={"dtype": torch.float8_e4m3fn})[0]


def _stored(model):
    from sd_accel.engine.fp8.upcast import is_fp8_stored
    return [m for m in model.model.diffusion_model.modules() if is_fp8_stored(m)]


@pytest.mark.parametrize("fp8_weights", ["as stored", "fp16 copies"])
def test_fp8_weights_choice_plans_copies_or_none_and_both_are_stock(tmp_path, monkeypatch, fp8_weights):
    model = _fp8_model(tmp_path)
    import comfy.model_management as mm
    from sd_accel.engine.fp8 import weights
    from sd_accel.hosts.comfyui import accelerate as host
    stored = _stored(model)
    assert stored, "ComfyUI loaded no weight as fp8 with manual cast"
    ref = comfy_inproc.sample_tiny(model, steps=2, cfg=5.0)
    mm.unload_all_models()
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    ours, info = host.accelerate(model, host.AccelOptions(fused_kernels=False, channels_last=False,
                                                          fp8_weights=fp8_weights))
    got = comfy_inproc.sample_tiny(ours, steps=2, cfg=5.0)
    mm.unload_all_models()
    assert torch.equal(got, ref), float((got - ref).abs().max())
    copies = [c for m in stored for c in weights.upcast_copies_of(m.weight)]
    if fp8_weights == "as stored":
        assert "fp8_upcast" not in info["patched"], info["patched"]
        assert "as stored" in info["reasons"]["fp8-stored weights"], info["reasons"]
        assert copies == []
    else:
        assert info["patched"].get("fp8_upcast") == len(stored), (info["patched"], len(stored))
        assert len(copies) == len(stored)


def test_the_run_report_says_the_weights_were_kept_as_stored():
    from sd_accel.engine.reports import run_report

    class Timer:
        cuda, seconds, peak_bytes = True, 1.0, 2 ** 30
    why = "kept as stored (fp8_weights 'as stored'): cast per call, as ComfyUI does, instead of 1.6 GiB of fp16 copies"
    r = run_report.build(20, Timer(), {}, {"replays": 20, "captures": 1}, {"cuda_graph": True, "channels_last": True},
                         host_reasons={"fp8-stored weights": why})
    assert "fp8-stored weights: " + why in r["notes"], r
