"""Where the ComfyUI host puts a step's graph when other packs' code runs around the UNet call, and the device
copy of a ModelSampling node's tables (hosts/comfyui/step_wrappers.py, hosts/comfyui/object_patches.py).
In-process, CPU."""

import pytest
import torch

import comfy_inproc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


def test_another_packs_diffusion_model_wrapper_puts_our_graph_inside_it():
    """EasyCache wraps the UNet call (DIFFUSION_MODEL) and decides on GPU values there: our graph then covers the
    UNet call alone, as the innermost wrapper, and the caller's dicts are not changed."""
    from sd_accel.hosts.comfyui import step_wrappers
    key = step_wrappers.WRAPPER_KEY

    def easycache(executor, *args, **kwargs):
        return executor(*args, **kwargs)

    def ours(executor, *args, **kwargs):
        return executor(*args, **kwargs)
    to = {"wrappers": {"diffusion_model": {"easycache": [easycache]}, "apply_model": {key: [ours]}},
          "sigmas": torch.ones(1)}
    assert step_wrappers.foreign_diffusion_wrappers(to) == ["easycache"]
    inner = step_wrappers._with_inner_wrapper(to, ours)
    assert list(inner["wrappers"]["diffusion_model"]) == ["easycache", key]
    assert inner["wrappers"]["diffusion_model"][key] == [ours]
    assert to["wrappers"]["diffusion_model"] == {"easycache": [easycache]}, "the caller's options are untouched"
    assert inner["sigmas"] is to["sigmas"]
    assert not step_wrappers.foreign_diffusion_wrappers({"wrappers": {"diffusion_model": {key: [ours]}}})
    assert not step_wrappers.foreign_diffusion_wrappers({})


def test_without_graphs_the_eager_path_sees_only_the_calls_that_reach_the_unet(model):
    """EasyCache's DIFFUSION_MODEL wrapper answers some steps from its cache without calling the UNet. With graphs
    off our step runs inside it too, so the eager path, which chooses between the fused and the stock modules by
    timing a key's first calls, never times a call that skipped the UNet: one such ~1 ms sample made the fused
    path look the faster on SDXL, where it was 8-22% slower than the stock modules."""
    from sd_accel.hosts.comfyui import accelerate as host
    if not hasattr(model, "add_wrapper_with_key"):
        pytest.skip("this ComfyUI has no DIFFUSION_MODEL wrappers (EasyCache came with them)")
    import comfy.patcher_extension as pe
    calls = {"wrapper": 0, "unet": 0}

    def caching(executor, x, *args, **kwargs):   # registered as EasyCache registers its own; skips every other call
        calls["wrapper"] += 1
        if calls["wrapper"] % 2 == 0:
            return x
        calls["unet"] += 1
        return executor(x, *args, **kwargs)
    patched = model.clone()
    patched.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "easycache", caching)
    acc, info = host.accelerate(patched, host.AccelOptions(cuda_graph=False))
    paths = info["graph_state"].graphs.eager_paths
    timed, run = [], paths.run
    paths.run = lambda key, fn, args, kwargs, device: timed.append(key) or run(key, fn, args, kwargs, device)
    try:
        got = comfy_inproc.sample_tiny(acc, steps=4)
    finally:
        del paths.run
    assert calls == {"wrapper": 4, "unet": 2}
    assert len(timed) == 2, "the eager path ran (and timed) only the calls that reached the UNet"
    calls.update(wrapper=0, unet=0)
    ref = comfy_inproc.sample_tiny(patched, steps=4)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_a_model_sampling_nodes_tables_get_a_device_copy_on_the_clone_only(model):
    """ModelSamplingDiscrete (v-prediction) builds its tables on the CPU; the accelerated clone gets a copy on
    the device (meta here standing for the GPU) as its own object patch; the node's object and model are
    untouched, and re-applying SD Accel starts again from the node's object."""
    import nodes as comfy_nodes  # noqa: F401  ComfyUI's, imported by comfy_inproc's loader
    from comfy_extras.nodes_model_advanced import ModelSamplingDiscrete
    from sd_accel.hosts.comfyui import object_patches as op
    patched = ModelSamplingDiscrete().patch(model, "v_prediction", False)[0]
    node_ms = patched.object_patches["model_sampling"]
    clone = patched.clone()
    assert op.model_sampling_on_device(clone, torch.device("meta"))
    copy = clone.object_patches["model_sampling"]
    assert copy is not node_ms and type(copy) is type(node_ms)
    assert copy.sigmas.device.type == "meta" and node_ms.sigmas.device.type == "cpu"
    assert not op.model_sampling_on_device(clone, torch.device("meta")), "already there"
    op.drop_ours(clone)
    assert clone.object_patches["model_sampling"] is node_ms
    assert not op.model_sampling_on_device(model.clone(), torch.device("meta")), "no ModelSampling patch: nothing"
