"""A fault in SD Accel's own set-up (a bug in planning the model's patches or the ControlNets' copies) never fails the
user's prompt: the Accelerated KSampler gives stock's latent bit for bit, its report says the set-up failed and why in
one line, Apply SD Accel hands back a model that samples as stock, and the user's model is untouched. With
SDACCEL_STRICT=1 (tests and benchmarks) the error goes through. In-process on a real ComfyUI (CPU); the fault is
injected where planning starts, standing for any bug there (ModelComputeDtype's torch.dtype object patch raised in
it until it was fixed)."""
import pytest
import torch

import comfy_inproc


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("set_up_fault")
    return comfy_inproc.tiny_model_patcher(folder), comfy_inproc.tiny_controlnet(folder)


@pytest.fixture(autouse=True)
def unload(monkeypatch):
    monkeypatch.delenv("SDACCEL_STRICT", raising=False)
    yield
    import comfy.model_management as mm
    mm.unload_all_models()


def _conds(cn=None):
    g = torch.Generator().manual_seed(11)
    extra = {}
    if cn is not None:
        hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
        extra = {"control": cn.copy().set_cond_hint(hint, 0.9)}
    return ([[torch.randn(1, 77, 768, generator=g), dict(extra)]],
            [[torch.randn(1, 77, 768, generator=g), dict(extra)]])


def _stock(model, pos, neg):
    import nodes
    with torch.inference_mode():
        return nodes.common_ksampler(model, 5, 2, 5.0, "euler", "normal", pos, neg,
                                     {"samples": torch.zeros(1, 4, 8, 8)})[0]["samples"]


def _ours(model, pos, neg, **options):
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    with torch.inference_mode():
        res = SDAccelKSampler().sample(model, 5, 2, 5.0, "euler", "normal", pos, neg,
                                       {"samples": torch.zeros(1, 4, 8, 8)}, **options)
    return res["result"][0]["samples"], res["ui"]["text"][0]


def _fail_planning(monkeypatch):
    from sd_accel.hosts.comfyui import object_patches

    def broken(*args, **kwargs):
        raise RuntimeError("injected planning fault")
    monkeypatch.setattr(object_patches, "drop_ours", broken)


def _state(model):
    return (dict(model.object_patches), {k: list(v) for k, v in model.patches.items()},
            getattr(model, "patches_uuid", None))


def test_a_set_up_fault_gives_stocks_latent_and_says_why(env, monkeypatch):
    base, _ = env
    model = base.clone()   # a fresh input: the clone cache lives on it
    pos, neg = _conds()
    ref = _stock(model, pos, neg)
    before = _state(model)
    _fail_planning(monkeypatch)
    got, line = _ours(model, pos, neg)
    assert torch.equal(got, ref), float((got - ref).abs().max())
    assert "set-up failed (RuntimeError: injected planning fault)" in line, line
    assert "runs as stock" in line, line
    assert _state(model) == before


def test_apply_sd_accel_after_a_set_up_fault_samples_as_stock(env, monkeypatch):
    from sd_accel.nodes.sampler_nodes import SDAccelApply
    base, _ = env
    model = base.clone()
    pos, neg = _conds()
    ref = _stock(model, pos, neg)
    _fail_planning(monkeypatch)
    res = SDAccelApply().apply(model)
    patched, line = res["result"][0], res["ui"]["text"][0]
    assert "set-up failed (RuntimeError: injected planning fault)" in line, line
    assert patched is not model
    assert not [k for k in patched.object_patches if k not in model.object_patches]
    got = _stock(patched, pos, neg)
    assert torch.equal(got, ref), float((got - ref).abs().max())


def test_a_controlnet_set_up_fault_runs_the_controlnet_as_stock(env, monkeypatch):
    """The model still runs accelerated (interpreted kernels here, fp32 rounding away from stock): the reference is
    the same node with its controlnet input off, which leaves the ControlNets to ComfyUI as they are."""
    base, cn = env
    model = base.clone()
    pos, neg = _conds(cn)
    ref, _ = _ours(model, pos, neg, controlnet=False)
    from sd_accel.hosts.comfyui import controlnet as host_cn

    def broken(*args, **kwargs):
        raise ValueError("injected ControlNet fault")
    monkeypatch.setattr(host_cn, "accelerate_conds", broken)
    got, line = _ours(model, pos, neg)
    assert torch.equal(got, ref), float((got - ref).abs().max())
    assert "ControlNets: SD Accel's set-up failed (ValueError: injected ControlNet fault): they run as stock" in line, \
        line


def test_strict_lets_a_set_up_fault_through(env, monkeypatch):
    base, _ = env
    model = base.clone()
    pos, neg = _conds()
    _fail_planning(monkeypatch)
    monkeypatch.setenv("SDACCEL_STRICT", "1")
    with pytest.raises(RuntimeError, match="injected planning fault"):
        _ours(model, pos, neg)
