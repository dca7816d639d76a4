"""A checkpoint a user switches away from must be freed once ComfyUI drops it, after Accelerated KSampler ran on it
(its clones, per-model graph state, eager-path choice, deferred previews, kernel reports and derived weight copies
all refer back to the model): a model kept alive is VRAM a server never gets back, one checkpoint switch at a
time. In process, through the node and ComfyUI's own unload, on both ComfyUIs."""
import gc
import weakref

import torch

import comfy_inproc


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
