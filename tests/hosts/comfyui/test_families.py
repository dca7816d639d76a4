"""A diffusion model other than an SD UNet (here a tiny random Flux, built by current ComfyUI's own model config) is
left to ComfyUI: nothing planned, no step wrapper, one line saying why, and the sampled latent is stock's to the
bit. Before, SD Accel swapped the DiT's LayerNorms for its stand-ins and put its step wrapper (CUDA graphs) on a
model family none of its tests covered. ComfyUI 2024 has no Flux: skipped there."""
import pytest
import torch

import comfy_inproc

FLUX = {"image_model": "flux", "guidance_embed": True, "in_channels": 16, "out_channels": 16, "vec_in_dim": 32,
        "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
        "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2, "qkv_bias": True}


def _tiny_flux():
    comfy_inproc.fixtures_module()
    import comfy.model_patcher
    import comfy.supported_models as sm
    if not hasattr(sm, "Flux"):
        pytest.skip("ComfyUI 2024 has no Flux model")
    config = sm.Flux(dict(FLUX))
    config.set_inference_dtype(torch.float32, None)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        base = config.get_model({})
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)


def _sample(model):
    import nodes
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 32, generator=g), {"pooled_output": torch.randn(1, 32, generator=g), "guidance": 3.5}]]
    with torch.inference_mode():
        return nodes.common_ksampler(model, 3, 2, 1.0, "euler", "simple", cond, cond,
                                     {"samples": torch.zeros(1, 16, 8, 8)})[0]["samples"]


def test_a_flux_model_is_left_to_comfyui_and_samples_as_stock():
    flux = _tiny_flux()
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    ref = _sample(flux)
    mm.unload_all_models()
    ours, info = host.accelerate(flux, host.AccelOptions())
    assert info["patched"] == {} and info["wrapper"] is None and not ours.object_patches, info
    why = info["reasons"][host.WHOLE_MODEL]
    assert "Flux" in why and "not an SD UNet" in why, why
    got = _sample(ours)
    mm.unload_all_models()
    assert torch.equal(got, ref), float((got - ref).abs().max())


def test_the_vram_pool_streams_no_block_of_a_flux_model_and_says_why():
    """lowvram block streaming cuts an SD UNet into units; a Flux model runs with ComfyUI's own partial loading under
    the budget, and the pool's notes say why (here with streaming forced, as the pool's tests force it on a CPU)."""
    flux = _tiny_flux()
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import memory as host_memory
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    ref = _sample(flux)
    mm.unload_all_models()
    clone = SDAccelVRAMPool().apply(flux, 8.0, "lowvram")["result"][0]
    settings = host_memory.pool_settings(clone)
    settings.stream_every_block = True
    got = _sample(clone)
    mm.unload_all_models()
    assert torch.equal(got, ref), float((got - ref).abs().max())
    notes = " ".join(settings.last_notes)
    assert "lowvram: off (the diffusion model is a Flux, not an SD UNet" in notes, notes
