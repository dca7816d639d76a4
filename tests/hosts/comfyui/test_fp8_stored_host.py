"""A checkpoint loaded with fp8 weights (what UNETLoader's weight_dtype fp8_e4m3fn does), through real ComfyUI in
process (CPU), with the nodes' `fp8_weights` choice: "fp16 copies" (the default) plans one kept fp16 copy per
fp8-stored Linear/Conv2d and makes them on the first step; "as stored" keeps the weights in fp8 (in half an fp16
model's memory) and casts a group of layers at a time at each step, copies only for the small timestep-embedding
projections, and says so. Both give stock's latent bit for bit.

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
    comfy_inproc.coarse_upcast_tiles(monkeypatch)
    ours, info = host.accelerate(model, host.AccelOptions(fused_kernels=False, channels_last=False,
                                                          fp8_weights=fp8_weights))
    got = comfy_inproc.sample_tiny(ours, steps=2, cfg=5.0)
    mm.unload_all_models()
    assert torch.equal(got, ref), float((got - ref).abs().max())
    copies = [c for m in stored for c in weights.upcast_copies_of(m.weight)]
    if fp8_weights == "as stored":
        # every layer cast a group at a time at each step (the timestep-embedding projections in groups of their
        # own), no copy kept
        assert "fp8_upcast" not in info["patched"], info["patched"]
        assert info["patched"].get("fp8_upcast_grouped") == len(stored), info["patched"]
        assert "as stored" in info["reasons"]["fp8-stored weights"], info["reasons"]
        assert copies == []
    else:
        assert info["patched"].get("fp8_upcast") == len(stored), (info["patched"], len(stored))
        assert len(copies) == len(stored)


def test_as_stored_with_the_fused_modules_casts_each_group_once_a_step_and_equals_the_copies(tmp_path, monkeypatch):
    """With the fused modules (the defaults), whose ResBlocks read every timestep-embedding projection and first
    conv bias at the first ResBlock: "as stored" computes exactly what "fp16 copies" computes, each group cast once
    per step (none cast early and kept to the step's end by those reads)."""
    model = _fp8_model(tmp_path)
    import comfy.model_management as mm
    from sd_accel.engine.fp8 import block_upcast
    from sd_accel.hosts.comfyui import accelerate as host
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    monkeypatch.setattr(block_upcast, "GROUP_BYTES", 64 << 10)    # the tiny UNet in several groups
    comfy_inproc.coarse_upcast_tiles(monkeypatch)
    casts, real = [], block_upcast.kernel.upcast_fp8

    def counting(sources, dst, layout, pointers):
        out = real(sources, dst, layout, pointers)
        counting.last_call = real.last_call
        casts.append(len(block_upcast._LOCAL.live) + 1)
        return out
    monkeypatch.setattr(block_upcast.kernel, "upcast_fp8", counting)
    got = {}
    for choice in ("fp16 copies", "as stored"):
        ours, info = host.accelerate(model, host.AccelOptions(cuda_graph=False, channels_last=False,
                                                              fp8_weights=choice))
        assert info["patched"].get("resblock_add_norm"), info
        got[choice] = comfy_inproc.sample_tiny(ours, steps=2, cfg=5.0)
        mm.unload_all_models()
    groups = {id(p.group) for p in ours.object_patches.values() if hasattr(p, "group")}
    assert torch.equal(got["as stored"], got["fp16 copies"])
    # 2 steps; the eager step runs each path once to time them (engine/graphs/eager.py) and then the faster one:
    # each call of the UNet casts every group once, with at most two alive
    assert casts and len(casts) % len(groups) == 0 and max(casts) <= 2, (len(casts), len(groups), max(casts))


def test_the_run_report_says_the_weights_were_kept_as_stored():
    from sd_accel.engine.reports import run_report

    class Timer:
        cuda, seconds, peak_bytes = True, 1.0, 2 ** 30
    why = ("kept as stored (fp8_weights 'as stored'): a group of layers cast at a time at each step, instead of 1.6 GiB "
           "of fp16 copies")
    r = run_report.build(20, Timer(), {}, {"replays": 20, "captures": 1}, {"cuda_graph": True, "channels_last": True},
                         host_reasons={"fp8-stored weights": why})
    assert "fp8-stored weights: " + why in r["notes"], r
