"""Where the ComfyUI host puts a step's graph when other packs' code runs around the UNet call, and the device
copy of a ModelSampling node's tables (hosts/comfyui/accelerate.py, hosts/comfyui/object_patches.py). In-process, CPU."""

import pytest
import torch

import comfy_inproc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


def test_another_packs_diffusion_model_wrapper_puts_our_graph_inside_it():
    """EasyCache wraps the UNet call (DIFFUSION_MODEL) and decides on GPU values there: our graph then covers the
    UNet call alone, as the innermost wrapper, and the caller's dicts are not changed."""
    from sd_accel.hosts.comfyui import accelerate as host

    def easycache(executor, *args, **kwargs):
        return executor(*args, **kwargs)

    def ours(executor, *args, **kwargs):
        return executor(*args, **kwargs)
    to = {"wrappers": {"diffusion_model": {"easycache": [easycache]}, "apply_model": {host.WRAPPER_KEY: [ours]}},
          "sigmas": torch.ones(1)}
    assert host.foreign_diffusion_wrappers(to) == ["easycache"]
    inner = host._with_inner_wrapper(to, ours)
    assert list(inner["wrappers"]["diffusion_model"]) == ["easycache", host.WRAPPER_KEY]
    assert inner["wrappers"]["diffusion_model"][host.WRAPPER_KEY] == [ours]
    assert to["wrappers"]["diffusion_model"] == {"easycache": [easycache]}, "the caller's options are untouched"
    assert inner["sigmas"] is to["sigmas"]
    assert not host.foreign_diffusion_wrappers({"wrappers": {"diffusion_model": {host.WRAPPER_KEY: [ours]}}})
    assert not host.foreign_diffusion_wrappers({})


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
