"""GPU only: the VRAM Pool's host copies (engine/memory/host_mirror.py) through ComfyUI's own loads and unloads. After a
pooled run, ComfyUI's unload of the UNet and the text encoder points their weights at pinned host copies; the
next unload copies nothing it has a copy of; a LoRA patched in between is not carried back (the plain model
holds its original weights bit for bit and samples stock's latent again), and the text encoder keeps its
weights and its encoding."""
import torch

from test_graphs_gpu import _lora, _rel, _sample, comfy_env  # noqa: F401  (the shared module fixture)


def _bits(t):
    """The tensor's bytes as integers: equal means bit for bit (a never-initialised weight may hold NaNs, which
    torch.equal calls unequal to themselves: SD1.5's unused text_projection, device run 37)."""
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _params_on_host_and_pinned(module):
    ps = list(module.parameters())
    return all(p.device.type == "cpu" for p in ps) and all(p.is_pinned() for p in ps)


def test_unloads_use_pinned_copies_and_patches_are_not_carried_back(comfy_env):  # noqa: F811
    import comfy.model_management as mm
    from sd_accel.engine.memory import host_mirror
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    env = comfy_env
    ref, _ = _sample(env, env.model, ours=False)
    unet_before = {n: p.detach().cpu().clone() for n, p in env.model.model.named_parameters()}
    te_before = {n: p.detach().cpu().clone() for n, p in env.clip.patcher.model.named_parameters()}
    with torch.inference_mode():
        cond_before = env.nodes.CLIPTextEncode().encode(env.clip, "a dog")[0][0][0].clone()
    pooled = SDAccelVRAMPool().apply(env.model, budget_gib=0.0, offload="lowvram")["result"][0]
    out, _ = _sample(env, pooled)                     # arms the UNet and the loaded text encoder
    assert _rel(out, ref) < 2e-2
    unet_mirror = host_mirror.mirror_of(env.model.model)
    te_mirror = host_mirror.mirror_of(env.clip.patcher.model)
    assert unet_mirror is not None and te_mirror is not None
    mm.unload_all_models()
    assert _params_on_host_and_pinned(env.model.model.diffusion_model)
    assert _params_on_host_and_pinned(env.clip.patcher.model)
    copied = unet_mirror.stats["copied_bytes"]
    assert copied > 0
    ptrs = {n: p.data_ptr() for n, p in env.model.model.named_parameters()}

    lora_out, _ = _sample(env, _lora(env, 1.0), ours=False)   # loads from the copies, with a LoRA patched in
    assert _rel(lora_out, ref) > 5e-2
    mm.unload_all_models()
    assert unet_mirror.stats["reused_bytes"] > 0
    after = {n: p.data_ptr() for n, p in env.model.model.named_parameters()}
    same = sum(after[n] == ptrs[n] for n in ptrs)
    assert same > len(ptrs) // 2, (same, len(ptrs))   # the untouched weights point at the same host copies

    for n, p in env.model.model.named_parameters():     # on the host now: the LoRA was not carried back
        assert p.device.type == "cpu" and torch.equal(_bits(p), _bits(unet_before[n])), n
    for n, p in env.clip.patcher.model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(_bits(p), _bits(te_before[n])), n
    again, _ = _sample(env, env.model, ours=False)
    # stock against stock in another memory state: cuDNN may pick other kernels (4e-3 seen on the H200)
    assert _rel(again, ref) < 1e-2, _rel(again, ref)
    with torch.inference_mode():
        cond_after = env.nodes.CLIPTextEncode().encode(env.clip, "a dog")[0][0][0]
    assert torch.allclose(cond_after.cpu().float(), cond_before.cpu().float(), rtol=1e-3, atol=1e-3)
