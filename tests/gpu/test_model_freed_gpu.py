"""GPU only: a checkpoint the user switches away from, after SD Accel ran on it with everything it keeps (the step's
CUDA graphs and their weights fingerprint, the VAE's graphed copy, the eager-path choice), is freed by reference
counting the moment the user's graph drops it, as stock's is: none of it may refer back in a cycle that only a
garbage collection frees. Until one runs, its weights stay in VRAM, and on current ComfyUI its loaded entry stays
listed with a live patcher; a collection started inside ComfyUI's free_memory then frees a patcher the unload loop
has listed, which fails on it and leaves the loaded list broken for every later prompt (tests/gpu's full run met
it in test_host_mirror_gpu's unload_all_models, and every later test failed)."""
import gc
import sys
import weakref

import torch

from refcount import no_garbage_collection
from test_graphs_gpu import comfy_env  # noqa: F401  (the shared module fixture)


def _holders(obj, depth=3):
    """What still refers to `obj`, a few levels up (for the failure message)."""
    out = []
    for r in gc.get_referrers(obj):
        if isinstance(r, dict):
            owners = [o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
            label = "dict of %s %s" % ([type(o).__name__ for o in owners], list(r)[:5])
            out.append((label, _holders(owners[0], depth - 1)) if owners and depth > 1 else label)
        elif not isinstance(r, (list, type(sys._getframe()))):
            out.append((type(r).__name__, _holders(r, depth - 1)) if depth > 1 else type(r).__name__)
    return out[:6]


def _assert_freed_and_comfyui_sound(refs):
    """Each weakly referenced object gone, ComfyUI's loaded list without a dead patcher, and its unload working."""
    import comfy.model_management as mm
    alive = [name for name, r in refs.items() if r() is not None]
    assert not alive, [(name, _holders(refs[name]())) for name in alive]
    assert all(lm.model is not None for lm in mm.current_loaded_models)
    mm.unload_all_models()


def test_a_dropped_checkpoint_with_graphs_is_freed_without_a_garbage_collection(comfy_env):  # noqa: F811
    from sd_accel.nodes.sampler_nodes import SDAccelApply
    from sd_accel.nodes.vae_nodes import SDAccelVAEDecode
    env = comfy_env
    with torch.inference_mode():
        model, clip, vae = env.nodes.CheckpointLoaderSimple().load_checkpoint("gpu_small.safetensors")[:3]
        lat = env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
        for _ in range(2):   # the second prompt replays the first's graphs
            res = env.ours.sample(model, 5, 4, 7.0, "euler", "normal", env.pos, env.neg, lat)
        assert res["ui"]["sdaccel_report"][0]["graphs"]["replays"] >= 1, res["ui"]["sdaccel_report"][0]["graphs"]
        applied = SDAccelApply().apply(model)["result"][0]
        out = env.nodes.KSampler().sample(applied, 5, 4, 7.0, "euler", "normal", env.pos, env.neg, lat)[0]
        SDAccelVAEDecode().decode(out, vae)
    refs = {"patcher": weakref.ref(model), "BaseModel": weakref.ref(model.model),
            "VAE": weakref.ref(vae.first_stage_model)}
    with no_garbage_collection():
        del model, clip, vae, applied, res, out
        _assert_freed_and_comfyui_sound(refs)


def test_a_checkpoint_dropped_after_lowvram_streaming_and_a_clip_copy_is_freed_at_once(comfy_env):  # noqa: F811
    """The same through the VRAM Pool's lowvram block streaming (its streamer, pinned buffers and host copies of the
    weights) with the text encoded through the pool and through Apply SD Accel (CLIP)'s graphed copy."""
    from sd_accel.nodes.clip_nodes import SDAccelApplyCLIP
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    env = comfy_env
    with torch.inference_mode():
        model, clip, vae = env.nodes.CheckpointLoaderSimple().load_checkpoint("gpu_small.safetensors")[:3]
        fast_clip = SDAccelApplyCLIP().apply(clip)["result"][0]
        for _ in range(2):
            pos = env.nodes.CLIPTextEncode().encode(fast_clip, "a cat")[0]
        pooled, pooled_clip = SDAccelVRAMPool().apply(model, budget_gib=0.0, offload="lowvram", clip=clip)["result"]
        neg = env.nodes.CLIPTextEncode().encode(pooled_clip, "")[0]
        lat = env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
        res = env.ours.sample(pooled, 5, 4, 7.0, "euler", "normal", pos, neg, lat)
    assert res["result"][0]["samples"].shape[0] == 1
    refs = {"patcher": weakref.ref(model), "BaseModel": weakref.ref(model.model),
            "text encoder": weakref.ref(clip.cond_stage_model)}
    with no_garbage_collection():
        del model, clip, vae, fast_clip, pooled, pooled_clip, pos, neg, res
        _assert_freed_and_comfyui_sound(refs)


def test_a_dropped_fp8_stored_unet_is_freed_without_a_garbage_collection(comfy_env):  # noqa: F811
    """An fp8-stored UNet (UNETLoader fp8_e4m3fn) sampled with its fp16 copies and "as stored" (the layers' forward
    patches and their upcast groups, set on the layers themselves), then dropped: its layers and weights go at once."""
    from test_fp8_gpu import fp8_stored_unet
    env = comfy_env
    unet = fp8_stored_unet()
    with torch.inference_mode():
        lat = env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
        for fp8_weights in ("fp16 copies", "as stored", "as stored"):
            res = env.ours.sample(unet, 5, 4, 7.0, "euler", "normal", env.pos, env.neg, lat, fp8_weights=fp8_weights)
    rep = res["ui"]["sdaccel_report"][0]
    assert any(r.startswith("fp8_upcast_group") for r in rep["ran"]) and rep["graphs"]["replays"] >= 1, rep
    layer = next(m for m in unet.model.diffusion_model.modules() if isinstance(m, torch.nn.Linear))
    refs = {"patcher": weakref.ref(unet), "BaseModel": weakref.ref(unet.model), "a Linear layer": weakref.ref(layer)}
    with no_garbage_collection():
        del unet, res, layer
        _assert_freed_and_comfyui_sound(refs)
