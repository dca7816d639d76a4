"""torch.compile as an object patch (what ComfyUI's TorchCompileModel did before it became a keyed wrapper, and
what packs that compile the UNet or one block of it do: `add_object_patch(path, torch.compile(module))`), met by
SD Accel in-process on the CPU, on either ComfyUI. tests/server/test_torch_compile.py covers the current node
through the real server.

torch.compile traces what runs inside the compiled module; SD Accel's stand-ins there (here: their kernels in
Triton's interpreter) make dynamo fail the sampler. SD Accel must leave a compiled UNet to torch.compile: the
latent is stock's with the same compile, to the bit, and the reason is said. Backend "eager": dynamo traces as
with any backend (which is where SD Accel's modules would be met) and runs the traced graph without a build.
"""
import pytest
import torch

import comfy_inproc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


def _compiled(model, path="diffusion_model"):
    import comfy.utils
    m = model.clone()
    m.add_object_patch(path, torch.compile(comfy.utils.get_attr(m.model, path), backend="eager"))
    return m


def _host():
    from sd_accel.hosts.comfyui import accelerate as host
    return host


@pytest.mark.parametrize("path", ["diffusion_model", "diffusion_model.input_blocks.1.1.transformer_blocks.0"])
def test_a_model_compiled_before_sd_accel_is_left_to_torch_compile(model, path):
    import comfy.model_management as mm
    host = _host()
    compiled = _compiled(model, path)
    ref = comfy_inproc.sample_tiny(compiled)
    mm.unload_all_models()
    ours, info = host.accelerate(compiled, host.AccelOptions())
    why = info["reasons"].get(host.WHOLE_MODEL) or ""
    assert "torch.compile" in why and path in why, info["reasons"]
    assert info["patched"] == {} and info["wrapper"] is None, info
    assert not [k for k in ours.object_patches if k not in compiled.object_patches]
    got = comfy_inproc.sample_tiny(ours)
    mm.unload_all_models()
    assert torch.equal(got, ref), float((got - ref).abs().max())


def test_the_diffusion_model_compiled_after_sd_accel_runs_the_hosts_modules(model):
    """Apply SD Accel, then a compile node: the stand-ins are planned, the compiled module wraps the diffusion model
    they are put in. Each call's step finds it compiled and runs the host's own modules, which dynamo traces."""
    import comfy.model_management as mm
    host = _host()
    ref = comfy_inproc.sample_tiny(_compiled(model))
    mm.unload_all_models()
    ours, info = host.accelerate(model, host.AccelOptions())
    assert info["patched"], info
    got = comfy_inproc.sample_tiny(_compiled(ours))
    mm.unload_all_models()
    assert torch.equal(got, ref), float((got - ref).abs().max())
    refused = info["graph_state"].graphs.refused
    assert [n for why, n in refused.items() if "torch.compile" in why and n >= 1], refused
