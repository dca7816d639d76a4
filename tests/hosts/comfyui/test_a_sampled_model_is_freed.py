"""A checkpoint a user switches away from must be freed once ComfyUI drops it, after Accelerated KSampler ran on it
(its clones, per-model graph state, eager-path choice, deferred previews, kernel reports and derived weight copies
all refer back to the model): a model kept alive is VRAM a server never gets back, one checkpoint switch at a
time. In process, through the node and ComfyUI's own unload, on both ComfyUIs."""
import gc
import weakref

import torch

import comfy_inproc
from refcount import no_garbage_collection


def _holders(obj):
    """Short names of what still refers to `obj` (for the failure message)."""
    out = []
    for r in gc.get_referrers(obj):
        if isinstance(r, dict):
            owners = [type(o).__name__ for o in gc.get_referrers(r) if hasattr(o, "__dict__") and o.__dict__ is r]
            out.append("dict of %s: %s" % (owners or "?", list(r)[:6]))
        elif not isinstance(r, list) or len(out) < 8:
            out.append(type(r).__name__)
    return out


def test_a_model_sampled_by_the_node_is_freed_when_comfyui_drops_it(tmp_path):
    model = comfy_inproc.tiny_model_patcher(tmp_path)
    import comfy.model_management as mm
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    dim = model.model.model_config.unet_config["context_dim"]
    cond = [[torch.randn(1, 77, dim), {}]]
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    with torch.inference_mode():
        out = SDAccelKSampler().sample(model, 1, 2, 7.0, "euler", "normal", cond, cond, latent)
    assert out["result"][0]["samples"].shape == (1, 4, 8, 8)
    ref = weakref.ref(model.model)
    del model, out
    mm.unload_all_models()
    gc.collect()
    assert ref() is None, _holders(ref())


def _dead_loaded_models(mm):
    """ComfyUI's loaded models whose patchers are all gone while their weights live (current ComfyUI tracks the
    patcher weakly and falls back to its parent; where none is alive, every later load runs a full garbage
    collection and warns "memory leak with model")."""
    return [lm for lm in mm.current_loaded_models if getattr(lm, "is_dead", lambda: False)()]


def test_dropping_a_patched_input_model_leaves_comfyui_no_dead_loaded_model(tmp_path, caplog):
    """A patch node's clone (FreeU, a LoRA; or both, one after the other) sampled by the node, then dropped when the
    user changes that patch:
    a garbage collection at any moment after must leave ComfyUI's list of loaded models sound, and the next load
    (stock KSampler on the checkpoint) must not warn of a leak."""
    import logging
    import comfy.model_management as mm
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    base = comfy_inproc.tiny_model_patcher(tmp_path)
    nodes = comfy_inproc.comfy_nodes()
    dim = base.model.model_config.unet_config["context_dim"]
    cond = [[torch.randn(1, 77, dim), {}]]
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    # the user changes a patch node's settings: a new clone each prompt; then a LoRA and a patch after it
    # (both dropped together when the LoRA changes)
    for depth in (1, 1, 2, 2):
        patched = base
        for _ in range(depth):
            patched = patched.clone()
        with torch.inference_mode():
            SDAccelKSampler().sample(patched, 1, 1, 7.0, "euler", "normal", cond, cond, latent)
        del patched
        gc.collect()
        assert not _dead_loaded_models(mm)
    with caplog.at_level(logging.WARNING):
        with torch.inference_mode():
            nodes.KSampler().sample(base, 1, 1, 7.0, "euler", "normal", cond, cond, latent)
    assert not [r for r in caplog.records if "memory leak" in r.getMessage()]
    mm.unload_all_models()


def _tracks_patchers_weakly(mm):
    """Current ComfyUI's loaded list refers to patchers weakly (a dropped one is freed while loaded); 2024's holds
    them until unloaded."""
    return hasattr(mm.LoadedModel, "_set_model")


def _sampled_both_ways(model):
    """The checkpoint through Accelerated KSampler, then through Apply SD Accel and stock KSampler."""
    from sd_accel.nodes.sampler_nodes import SDAccelApply, SDAccelKSampler
    nodes = comfy_inproc.comfy_nodes()
    dim = model.model.model_config.unet_config["context_dim"]
    cond = [[torch.randn(1, 77, dim), {}]]
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    with torch.inference_mode():
        SDAccelKSampler().sample(model, 1, 2, 7.0, "euler", "normal", cond, cond, latent)
        applied = SDAccelApply().apply(model)["result"][0]
        nodes.KSampler().sample(applied, 1, 2, 7.0, "euler", "normal", cond, cond, latent)


def test_a_dropped_checkpoint_is_freed_at_once_without_a_garbage_collection(tmp_path):
    """Freed by reference counting, as stock's is, not left to a garbage collection: the accelerated clone's parent
    was the checkpoint that caches it (a cycle). Until a collection ran, the dropped model kept its weights and,
    on current ComfyUI, its loaded entry; a collection started by an allocation inside ComfyUI's free_memory then
    freed a patcher its unload loop had listed, which failed on it (AttributeError on `.model.model`) and left the
    loaded list broken for every later prompt (tests/gpu's full run met it in unload_all_models). The per-model
    graph state on the BaseModel referred back to it too (its weights fingerprint)."""
    import comfy.model_management as mm
    model = comfy_inproc.tiny_model_patcher(tmp_path)
    _sampled_both_ways(model)
    if not _tracks_patchers_weakly(mm):
        mm.unload_all_models()
    patcher, base = weakref.ref(model), weakref.ref(model.model)
    with no_garbage_collection():
        del model
        assert patcher() is None, _holders(patcher())
        assert base() is None, _holders(base())
        assert all(lm.model is not None for lm in mm.current_loaded_models)
        mm.unload_all_models()


def test_a_clone_replaced_while_loaded_is_kept_until_comfyui_lets_go_of_it(tmp_path):
    """The checkpoint's own patches changed in place (a pack patching the loader's model without cloning it): the
    cached clone is replaced. ComfyUI still has the old one loaded, and a root input's clone has no parent to
    fall back to, so it stays alive until ComfyUI unloads it: freed while loaded, its entry would outlive it
    beside the live weights (ComfyUI's "memory leak" and a full collection on every later load)."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    model = comfy_inproc.tiny_model_patcher(tmp_path)
    first, _ = host.accelerate(model, host.AccelOptions())
    comfy_inproc.sample_tiny(first)
    old = weakref.ref(first)
    del first
    key = next(iter(model.model.diffusion_model.state_dict()))
    model.add_patches({key: (torch.zeros_like(model.model.diffusion_model.state_dict()[key]),)}, 0.0)
    second, _ = host.accelerate(model, host.AccelOptions())
    assert second is not old()
    gc.collect()
    assert old() is not None and any(lm.model is old() for lm in mm.current_loaded_models)
    assert not _dead_loaded_models(mm)
    comfy_inproc.sample_tiny(second)          # loading the new clone unloads the old one
    assert not any(lm.model is old() for lm in mm.current_loaded_models)
    host.accelerate(model, host.AccelOptions())   # the next call lets it go
    gc.collect()
    assert old() is None
    assert not _dead_loaded_models(mm)
    mm.unload_all_models()


def test_a_vae_through_the_vae_nodes_is_freed_without_a_garbage_collection(tmp_path):
    """VAE Decode / VAE Encode / Apply SD Accel (VAE) cache their copy of a VAE on its patcher; where nothing applies
    (here: the CPU) the "copy" is the VAE itself, and caching it there was a cycle that kept a dropped VAE (its
    weights, in VRAM on a GPU where the copy is refused) until a garbage collection ran."""
    path = comfy_inproc.tiny_checkpoint(tmp_path)       # ComfyUI importable from here on
    import comfy.model_management as mm
    import comfy.sd
    from sd_accel.nodes.vae_nodes import SDAccelApplyVAE, SDAccelVAEDecode, SDAccelVAEEncode
    for node in ("decode", "encode", "apply"):
        with torch.inference_mode():
            vae = comfy.sd.load_checkpoint_guess_config(path, output_vae=True, output_clip=False,
                                                        output_model=False)[2]
            lat = {"samples": torch.zeros(1, 4, 8, 8)}
            if node == "decode":
                SDAccelVAEDecode().decode(lat, vae)
            elif node == "encode":
                SDAccelVAEEncode().encode(torch.zeros(1, 64, 64, 3), vae)
            else:
                applied = SDAccelApplyVAE().apply(vae)["result"][0]
                comfy_inproc.comfy_nodes().VAEDecode().decode(applied, lat)
                del applied
        if not _tracks_patchers_weakly(mm):      # ComfyUI 2024 holds a loaded patcher until it unloads it
            mm.unload_all_models()
        ref = weakref.ref(vae.first_stage_model)
        with no_garbage_collection():
            del vae
            assert ref() is None, (node, _holders(ref()))
