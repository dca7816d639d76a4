"""scripts/sd_accel.py in a Forge process: the stand-ins of A1111's API (fake_a1111/, which Forge keeps)
and of Forge's backend (fake_forge/), started in Forge's order."""
import torch

from forge_util import ForgeSdModel, denoise, make_patcher
from test_extension import KEYS
from unet_util import load_extension_script


class App:
    def __init__(self):
        self.routes = {}

    def add_api_route(self, path, fn, methods):
        self.routes[path] = fn


def start_forge(stock_kernels, sd_model=None):
    """Forge's start-up: its built-in ControlNet imports the API, the scripts are imported, the app starts,
    the model is loaded."""
    from modules import script_callbacks, sd_models, shared
    from modules.api import models  # noqa: F401
    ext = load_extension_script()
    stock_kernels()
    api_model = shared.api_options_model()
    app = App()
    script_callbacks.app_started_callback(None, app)
    status = app.routes["/sd_accel/status"]
    before = status()
    sd_model = sd_model or ForgeSdModel(make_patcher())
    sd_models.load_model(sd_model)
    return ext, api_model, status, before, sd_model


def run_generation(ext, sd_model):
    """What Forge does per sampling run: the scripts' process_before_every_sampling on a fresh copy of
    the model's patcher, then the sampler through the (possibly replaced) patcher."""
    p = type("P", (), {"sd_model": sd_model})()
    ext.SDAccelScript().process_before_every_sampling(p)
    return denoise(sd_model.forge_objects.unet)


def test_forge_status_options_and_a_run(fake_a1111, fake_forge, stock_kernels, capsys):
    from modules import shared
    ref_model = ForgeSdModel(make_patcher())
    ref = denoise(ref_model.forge_objects.unet)
    from backend import memory_management
    memory_management.unload_all()
    ext, api_model, status, before, sd_model = start_forge(stock_kernels)
    assert ext.IS_FORGE and before["forge"] is True and before["model"] is None
    assert {k: shared.api_get_options(api_model).get(k, "MISSING") for k in KEYS} == {k: True for k in KEYS}
    loaded = status()
    assert loaded["model"] == "UNetModel" and loaded["runs"] == 0
    assert loaded["patched"] == sum(loaded["counts"].values()) == 47 and loaded["counts"]["geglu"] == 4
    base = sd_model.forge_objects.unet
    k0 = loaded["kernels"]
    out = run_generation(ext, sd_model)
    assert sd_model.forge_objects.unet is not base and base.object_patches == {}
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    s = status()
    assert s["runs"] == 1 and s["patched"] == 47 and s["graphs"]["eager"] == 1
    calls = {op: e["fused"] + e["fallback"] - k0.get(op, {}).get("fused", 0) - k0.get(op, {}).get("fallback", 0)
             for op, e in s["kernels"].items()}
    assert calls == {"group_norm_silu": 6, "group_norm": 4, "layer_norm": 12, "geglu": 4, "resblock_add_norm": 5,
                     "resblock_bias_residual": 5}
    printed = capsys.readouterr().out
    assert "[SD Accel] model loaded (Forge): each generation patches 47 modules" in printed
    assert "None" not in "".join(ln for ln in printed.splitlines() if "SD Accel" in ln)


def test_forge_disabled_gives_forge_its_own_patcher(fake_a1111, fake_forge, stock_kernels):
    from modules import shared
    ext, _, status, _, sd_model = start_forge(stock_kernels)
    base = sd_model.forge_objects.unet
    shared.opts.set("sd_accel_enabled", False, is_api=True)
    run_generation(ext, sd_model)
    assert sd_model.forge_objects.unet is base and status()["patched"] == 0
    shared.opts.set("sd_accel_enabled", True, is_api=True)
    run_generation(ext, sd_model)
    assert status()["patched"] == 47


def test_forge_says_fp8_is_not_offered_and_runs_fp16(fake_a1111, fake_forge, stock_kernels, capsys):
    from modules import shared
    ext, _, status, _, sd_model = start_forge(stock_kernels)
    ref = run_generation(ext, sd_model)
    capsys.readouterr()
    shared.opts.set("sd_accel_precision", "fp8", is_api=True)
    assert "precision fp8 not used: not offered on Forge" in capsys.readouterr().out
    out = run_generation(ext, sd_model)
    s = status()
    assert s["precision"] == "fp16" and s["reasons"] == {"precision fp8": ext.forge.FP8_REFUSAL}
    assert torch.equal(out, ref)
