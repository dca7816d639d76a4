"""Other packs' mechanisms (the stand-ins of tests/packs, docs/other_packs.md) in-process on the CPU, where a
test needs SD Accel's GPU plan: the channels_last stand-ins are planned only for a CUDA load device, so the
check is forced here as tests/hosts/comfyui/test_comfy_host.py does. The server tests (tests/server/test_other_packs.py)
cover the rest through a real ComfyUI."""
import importlib.util
import os
import sys

import pytest

import comfy_inproc

PACKS = os.path.join(comfy_inproc.REPO, "tests", "packs")


def _load_pack(name):
    """A stand-in pack imported as ComfyUI imports a custom-node folder (its __init__.py as a package)."""
    if name not in sys.modules:
        path = os.path.join(PACKS, name, "__init__.py")
        spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[os.path.dirname(path)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _sample_batch4(model):
    return comfy_inproc.sample_tiny(model, batch=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


def test_animatediff_places_its_modules_as_on_stock_with_our_gpu_layout_stand_ins(model, monkeypatch):
    """On a GPU, channels_last puts a SpatialTransformer stand-in (a subclass) in each block. AnimateDiff places
    its temporal module after the block's last `type(c) == SpatialTransformer` (an exact class test), else after
    the first ResBlock: with the stand-in in place it lands before the transformer, another network."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    ad = _load_pack("standin_animatediff")
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    animated = ad.ADLikeApplyMotion().apply(model, 5, "v2", 0, 4, "standard_uniform", "pyramid")[0]
    mm.unload_all_models()
    ours, info = host.accelerate(animated, host.AccelOptions(fused_kernels=False, cuda_graph=False))
    assert info["patched"].get("channels_last_transformer"), info["patched"]
    got = _sample_batch4(ours)
    mm.unload_all_models()
    ref = _sample_batch4(animated)
    mm.unload_all_models()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-4, rel


def test_the_gpu_layout_stand_ins_alone_match_stock_on_this_cpu(model, monkeypatch):
    """The control for the test above: without AnimateDiff the same forced plan gives stock's latent."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    mm.unload_all_models()
    ours, _ = host.accelerate(model.clone(), host.AccelOptions(fused_kernels=False, cuda_graph=False))
    got = _sample_batch4(ours)
    mm.unload_all_models()
    ref = _sample_batch4(model)
    mm.unload_all_models()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-4, rel
