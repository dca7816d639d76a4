"""nodes/sampler_nodes.py's step_cache inputs (LOSSY wherever they appear) and what the nodes report, in-process
on a real ComfyUI (CPU) with a tiny random SD1.5 checkpoint."""
import pytest
import torch

import comfy_inproc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(autouse=True)
def _unload():
    yield
    import comfy.model_management as mm
    mm.unload_all_models()


def _nodes():
    comfy_inproc.comfy_nodes()
    from sd_accel.nodes import sampler_nodes
    return sampler_nodes


def _keyed():
    import comfy.model_patcher
    return hasattr(comfy.model_patcher.ModelPatcher, "add_wrapper_with_key")


@pytest.mark.parametrize("node", ["SDAccelKSampler", "SDAccelApply"])
def test_step_cache_inputs_are_optional_off_by_default_and_say_lossy(node):
    cls = _nodes().NODE_CLASS_MAPPINGS[node]
    opt = cls.INPUT_TYPES()["optional"]
    choices, spec = opt["step_cache"]
    assert choices[0] == "off" and spec["default"] == "off" and "interval 3" in choices and "non-uniform 3" in choices
    assert spec["tooltip"].startswith("LOSSY")
    assert "LOSSY" in opt["step_cache_branch"][1]["tooltip"] and opt["step_cache_branch"][1]["default"] == 0
    assert "lossy" in cls.DESCRIPTION and "step_cache" in cls.DESCRIPTION


def _ksampler(model, **kw):
    g = torch.Generator().manual_seed(11)
    pos = [[torch.randn(1, 77, 768, generator=g), {}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {}]]
    with torch.inference_mode():
        return _nodes().SDAccelKSampler().sample(model, 3, 4, 5.0, "euler", "normal", pos, neg,
                                                 {"samples": torch.zeros(1, 4, 8, 8)}, fused_kernels=False,
                                                 cuda_graph=False, channels_last=False, **kw)


def test_the_report_says_lossy_and_how_many_steps_were_cached(model):
    out = _ksampler(model, step_cache="interval 2")
    report, line = out["ui"]["sdaccel_report"][0], out["ui"]["text"][0]
    if not _keyed():
        assert "ComfyUI 2024" in report["fell_back"]["step_cache"] and "LOSSY" not in line
        return
    ran = [r for r in report["ran"] if r.startswith("step_cache")]
    assert ran == ["step_cache interval 2 (LOSSY: 2 of 4 steps ran the shallow blocks only, branch 0)"]
    assert ran[0] in line and report["step_cache"]["cached_calls"] == 2
    off = _ksampler(model)["ui"]["sdaccel_report"][0]
    assert off["step_cache"] is None and not any("step_cache" in r for r in off["ran"])
    assert "step_cache" not in off["fell_back"]


def test_apply_says_lossy_or_why_it_refused(model):
    line = _nodes().SDAccelApply().apply(model, False, False, False, step_cache="non-uniform 3")["ui"]["text"][0]
    if _keyed():
        assert "step_cache non-uniform 3: LOSSY, branch 0" in line
    else:
        assert "step_cache non-uniform 3: refused: this ComfyUI has no DIFFUSION_MODEL" in line
    assert "step_cache" not in _nodes().SDAccelApply().apply(model, False, False, False)["ui"]["text"][0]


@pytest.mark.parametrize("node", ["SDAccelKSampler", "SDAccelApply"])
def test_precision_input_is_optional_fp16_by_default_and_says_lossy(node):
    cls = _nodes().NODE_CLASS_MAPPINGS[node]
    choices, spec = cls.INPUT_TYPES()["optional"]["precision"]
    assert choices == ["fp16", "fp8"] and spec["default"] == "fp16"
    assert spec["tooltip"].startswith("LOSSY") and "sm_89/sm_90" in spec["tooltip"]
    assert "precision fp8" in cls.DESCRIPTION


def test_fp8_on_this_cpu_samples_fp16_and_says_why(model):
    fp8 = _ksampler(model, precision="fp8")
    fp16 = _ksampler(model)
    assert torch.equal(fp8["result"][0]["samples"], fp16["result"][0]["samples"])
    report, line = fp8["ui"]["sdaccel_report"][0], fp8["ui"]["text"][0]
    assert "sm_89/sm_90" in report["fell_back"]["precision fp8"], report
    assert not any(r.startswith("fp8_linear") for r in report["ran"]) and "LOSSY" not in line
