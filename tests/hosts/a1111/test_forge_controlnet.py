"""Forge's built-in ControlNet under SD Accel (hosts/forge_controlnet.py), on the stand-ins of Forge's UNet
patcher, sampling call and ControlNet classes (fake_forge/; the real Forge: dev/forge_check.py's ControlNet
check): the hook SD Accel sets runs a full ControlNet's control model with the fused modules and gives Forge's
control; the control model is never modified; other control types get exactly Forge's own call."""
import pytest
import torch

from sd_accel.engine.graphs import eager
from sd_accel.engine.reports import kernel_report
from sd_accel.hosts import forge, forge_controlnet, webui

from forge_util import denoise, make_controlnet, make_patcher

ON = webui.WebUIOptions()
HOOK = "controlnet_model_function_wrapper"


def _control(patcher, cn, seed=2):
    """The ControlNet chain's control for one batch, through the sampling stand-in's route (the patcher's
    transformer_options given to every link)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 4, 4, generator=g)
    ctx = torch.randn(1, 5, 32, generator=g)
    m = patcher.clone()
    m.add_patched_controlnet(cn)
    cn.transformer_options = dict(m.model_options.get("transformer_options", {}))
    with torch.no_grad():
        return cn.get_control(x, torch.tensor([500.0]), {"c_crossattn": ctx}, 1)


def _tree(module):
    return [(name, id(m)) for name, m in module.named_modules()], [id(p) for p in module.parameters()]


@pytest.fixture
def fused_path(monkeypatch):
    """The fused modules on the eager path (a CPU has no timing to choose by; they run their torch references)."""
    monkeypatch.setattr(eager, "FORCED_PATH", "fused")


def test_a_full_controlnets_control_model_runs_fused_and_gives_forges_control(fake_forge, stock_kernels, fused_path):
    base = make_patcher()
    cn = make_controlnet()
    ref = _control(base, cn.copy())
    tree = _tree(cn.control_model)
    clone, info = forge.accelerate(base, ON)
    assert forge_controlnet.is_ours(clone.model_options["transformer_options"][HOOK])
    assert HOOK not in base.model_options.get("transformer_options", {})
    for run in range(2):
        forge.accelerate(base, ON)   # a new sampling run
        before = kernel_report.snapshot()
        out = _control(clone, cn.copy())
        ran = {op: e["fused"] + e["fallback"] for op, e in webui.kernel_summary(before).items()}
        # the control model's 3 ResBlocks (each's out norm inside its own op), 2 transformers
        assert ran == {"group_norm_silu": 3, "resblock_add_norm": 3, "resblock_bias_residual": 3, "group_norm": 2,
                       "layer_norm": 6, "geglu": 2}, ran
        assert len(out) == len(ref) and all(torch.allclose(o, r, atol=2e-5, rtol=1e-4) for o, r in zip(out, ref))
    assert _tree(cn.control_model) == tree   # the control model itself untouched
    [entry] = [e for e in forge_controlnet.status() if e["calls"]]
    assert entry["last"] == "accelerated" and entry["patched"] > 0 and entry["counts"] == {
        "group_norm_silu": 6, "silu_folded": 6, "resblock": 3, "group_norm": 2, "layer_norm": 6, "geglu": 2}, entry
    # the control model run without the hook afterwards (SD Accel off) is Forge's, bit for bit
    again = _control(base, cn.copy())
    assert all(torch.equal(a, r) for a, r in zip(again, ref))


def test_the_twins_resblocks_share_one_timestep_projection(fake_forge, stock_kernels, fused_path, monkeypatch):
    """The twin holds the plan's ResBlock stand-ins themselves (not copies of them), so their timestep projections
    run as one GEMM for the whole control model, as on the UNet (engine/patches/emb_projections.py)."""
    from backend import operations
    from sd_accel.engine.patches import emb_projections
    # the stand-in's Linear is not read as Forge's (its forward's source differs); counted as one here, as Forge's is
    monkeypatch.setattr(emb_projections, "LINEAR_CLASSES", emb_projections.LINEAR_CLASSES + [operations.Linear])
    answered = []
    real = emb_projections.EmbProjections.projection

    def spy(self, block, emb):
        out = real(self, block, emb)
        answered.append(out is not None)
        return out
    monkeypatch.setattr(emb_projections.EmbProjections, "projection", spy)
    base = make_patcher()
    cn = make_controlnet()
    clone, _ = forge.accelerate(base, ON)
    _control(clone, cn.copy())
    assert answered and all(answered), answered   # every ResBlock of the control model served from the batch


def test_the_twin_sees_forges_weight_changes(fake_forge, stock_kernels, fused_path):
    """The twin shares the control model's parameter tables: a weight Forge changes (a load, a merge) is read."""
    base = make_patcher()
    cn = make_controlnet()
    clone, _ = forge.accelerate(base, ON)
    _control(clone, cn.copy())
    conv = cn.control_model.zero_convs[0][0]
    with torch.no_grad():
        conv.weight.mul_(3.0)
        conv.weight = torch.nn.Parameter(conv.weight * 0.5, requires_grad=False)   # a new Parameter object
    ref = _control(base, cn.copy())
    forge.accelerate(base, ON)
    out = _control(clone, cn.copy())
    assert all(torch.allclose(o, r, atol=2e-5, rtol=1e-4) for o, r in zip(out, ref))


def test_other_control_types_get_forges_own_call(fake_forge, stock_kernels, fused_path):
    from backend import cldm
    from backend.patcher.controlnet import ControlLora, T2IAdapter
    base = make_patcher()
    clone, _ = forge.accelerate(base, ON)
    lora_cn = make_controlnet()
    lora = ControlLora(lora_cn.control_model).set_cond_hint(lora_cn.cond_hint_original)
    torch.manual_seed(3)
    t2i = T2IAdapter(cldm.T2IModel(32).eval()).set_cond_hint(torch.rand(1, 3, 8, 8))
    for cn in (lora, t2i):
        ref = _control(base, cn.copy() if hasattr(cn, "copy") else cn)
        before = kernel_report.snapshot()
        out = _control(clone, cn.copy() if hasattr(cn, "copy") else cn)
        assert not webui.kernel_summary(before), type(cn).__name__
        assert all(torch.equal(o, r) for o, r in zip(out, ref)), type(cn).__name__
    assert any(e["last"] == "ControlLora is not a full ControlNet" for e in forge_controlnet.status())


def test_another_extensions_hook_is_kept_and_sd_accel_off_takes_ours_out(fake_forge, stock_kernels):
    base = make_patcher()
    theirs = base.clone()

    def their_hook(**kw):
        return kw["inner_model"](x=kw["x"], hint=kw["hint"], timesteps=kw["timesteps"], context=kw["context"])
    theirs.set_controlnet_model_function_wrapper(their_hook)
    clone, info = forge.accelerate(theirs, ON)
    assert clone.model_options["transformer_options"][HOOK] is their_hook
    assert "another extension's" in info["reasons"]["controlnet"]
    ours, _ = forge.accelerate(base, ON)
    off = forge.strip(ours)
    assert HOOK not in off.model_options["transformer_options"] and HOOK in ours.model_options["transformer_options"]


def test_a_controlnet_in_forges_sampling_call_runs_through_the_hook(fake_forge, stock_kernels, fused_path):
    """Forge's ControlNet clones SD Accel's patcher and adds itself (its script runs after SD Accel's); the
    sampling call hands the chain the batch's transformer_options, where the hook is."""
    base = make_patcher()
    clone, _ = forge.accelerate(base, ON)
    m = clone.clone()
    m.add_patched_controlnet(make_controlnet())
    ref = denoise(clone)
    out = denoise(m)
    torch.testing.assert_close(out, ref)   # the stand-in UNet does not read the control
    assert any(e["calls"] and e["last"] == "accelerated" for e in forge_controlnet.status())


def test_a_control_model_sd_accel_cannot_plan_runs_as_forge_made_it(fake_forge, stock_kernels, monkeypatch):
    """Whatever goes wrong while planning a control model, the generation goes on with Forge's own call, and the
    status says why in one line."""
    from sd_accel.hosts import forge_plan

    def broken(*a, **k):
        raise RuntimeError("an unexpected module tree")
    base = make_patcher()
    cn = make_controlnet()
    ref = _control(base, cn.copy())
    clone, _ = forge.accelerate(base, ON)
    monkeypatch.setattr(forge_plan, "plan_for", broken)   # the control model is planned at its first call
    out = _control(clone, cn.copy())
    assert all(torch.equal(o, r) for o, r in zip(out, ref))
    assert any("could not plan the control model (RuntimeError: an unexpected module tree)" in (e["last"] or "")
               for e in forge_controlnet.status())
