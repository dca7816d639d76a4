"""scripts/sd_accel.py through a stand-in of A1111's API (fake_a1111/): settings, callbacks, reloads."""
import torch

from sd_accel.engine.patches import fused_modules as fm
from unet_util import FakeSdModel, load_extension_script, make_unet, unet_inputs

KEYS = ("sd_accel_enabled", "sd_accel_fused_kernels", "sd_accel_cuda_graph", "sd_accel_channels_last")


def fused_count(unet):
    return sum(1 for m in unet.modules() if fm.kind_of(m))


def run(unet, inputs):
    with torch.no_grad():
        return unet(*inputs)


def start(fake_a1111, stock_kernels, model=None):
    """A1111 start-up order: scripts imported, API options model built (--nowebui), model loaded."""
    from modules import sd_models, shared
    ext = load_extension_script()
    stock_kernels()
    api_model = shared.api_options_model()
    sd_model = model or FakeSdModel(make_unet())
    sd_models.load_model(sd_model)
    return ext, api_model, sd_model


def test_options_listed_when_the_api_was_imported_first(fake_a1111, stock_kernels):
    """Forge's built-in ControlNet imports the API before user extensions load, which builds the API's
    options model without ours: the GET must list them all the same."""
    from modules import shared
    from modules.api import models  # noqa: F401 - imported first, as there
    load_extension_script()
    got = shared.api_get_options(shared.api_options_model())
    assert {k: got.get(k, "MISSING") for k in KEYS} == {k: True for k in KEYS}
    assert got["sd_accel_cuda_graph"] is True and len(got) == len(shared.opts.data)


def test_options_registered_at_import_are_in_the_api(fake_a1111, stock_kernels):
    from modules import script_callbacks, shared
    ext, api_model, _ = start(fake_a1111, stock_kernels)
    assert ext.host is not None and ext.host.__name__.startswith("sd_accel_ext_")
    got = shared.api_get_options(api_model)
    assert {k: got[k] for k in KEYS} == {k: True for k in KEYS}
    for k in KEYS:   # their own section, in the category of A1111's "Optimizations" section
        assert shared.opts.data_labels[k].section == ("sd_accel", "SD Accel")
        assert shared.opts.data_labels[k].category_id == "sd"
    script_callbacks.ui_settings_callback()   # registering again changes nothing
    assert shared.api_get_options(api_model) == got


def test_a_saved_value_survives_registration(fake_a1111, stock_kernels):
    from modules import shared
    shared.opts.data["sd_accel_fused_kernels"] = False   # as loaded from config.json
    _, _, sd_model = start(fake_a1111, stock_kernels)
    assert shared.opts.sd_accel_fused_kernels is False
    assert fused_count(sd_model.model.diffusion_model) == 0


def test_model_loaded_applies_and_vae_reload_is_idempotent(fake_a1111, stock_kernels):
    from modules import sd_models
    unet = make_unet()
    inputs = unet_inputs()
    ref = run(unet, inputs)
    _, _, sd_model = start(fake_a1111, stock_kernels, FakeSdModel(unet))
    assert fused_count(unet) == 42
    mods = dict(unet.named_modules())
    sd_models.reload_vae()          # A1111 runs the model-loaded callbacks again
    assert all(dict(unet.named_modules())[k] is m for k, m in mods.items())
    torch.testing.assert_close(run(unet, inputs), ref, atol=2e-5, rtol=1e-4)


def test_toggle_off_restores_and_on_reapplies(fake_a1111, stock_kernels):
    from modules import shared
    unet = make_unet()
    orig = dict(unet.named_modules())
    inputs = unet_inputs()
    ref = run(unet, inputs)
    start(fake_a1111, stock_kernels, FakeSdModel(unet))
    assert shared.opts.set("sd_accel_enabled", False, is_api=True)
    assert fused_count(unet) == 0
    assert all(dict(unet.named_modules())[k] is m for k, m in orig.items())
    assert shared.opts.set("sd_accel_enabled", True, is_api=True)
    assert fused_count(unet) == 42
    assert shared.opts.set("sd_accel_fused_kernels", False, is_api=True)
    assert fused_count(unet) == 0
    assert shared.opts.set("sd_accel_fused_kernels", True, is_api=True)
    torch.testing.assert_close(run(unet, inputs), ref, atol=2e-5, rtol=1e-4)


def test_same_object_checkpoint_switch_loads_every_key(fake_a1111, stock_kernels):
    """A1111 switches between same-config checkpoints by load_state_dict(strict=False) on the SAME
    patched model object, then runs the callbacks again."""
    from modules import sd_models
    _, _, sd_model = start(fake_a1111, stock_kernels)
    unet = sd_model.model.diffusion_model
    other = FakeSdModel(make_unet(seed=5))
    inputs = unet_inputs()
    result = sd_models.reload_model_weights(other.state_dict(), model_name="other")
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert sd_models.model_data.sd_model is sd_model and fused_count(unet) == 42
    torch.testing.assert_close(run(unet, inputs), run(other.model.diffusion_model, inputs), atol=2e-5, rtol=1e-4)


def test_script_unloaded_restores(fake_a1111, stock_kernels):
    from modules import script_callbacks
    unet = make_unet()
    orig = dict(unet.named_modules())
    start(fake_a1111, stock_kernels, FakeSdModel(unet))
    script_callbacks.script_unloaded_callback()
    assert fused_count(unet) == 0
    assert all(dict(unet.named_modules())[k] is m for k, m in orig.items())


def test_status_route(fake_a1111, stock_kernels):
    from modules import script_callbacks, shared
    start(fake_a1111, stock_kernels)
    routes = {}

    class App:
        def add_api_route(self, path, fn, methods):
            routes[path] = (fn, methods)

    script_callbacks.app_started_callback(None, App())
    fn, methods = routes["/sd_accel/status"]
    assert methods == ["GET"]
    s = fn()
    assert s["patched"] == 42 and s["state_dict_keys_unchanged"] is True and s["options"]["enabled"] is True
    assert sum(s["counts"].values()) == s["patched"] and s["forge"] is False
    assert s["settings"] == {"section": "SD Accel", "category": "Stable Diffusion"}
    shared.opts.set("sd_accel_enabled", False, is_api=True)
    assert fn()["patched"] == 0 and fn()["paths"] == []


def test_cuda_graph_unet_route(fake_a1111, stock_kernels, monkeypatch):
    """The SdUnet route: listed by on_list_unets, picked by 'Automatic', A1111's class forward goes
    through it (eager on CPU: no CUDA device), toggling the setting deactivates it."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    from modules import sd_hijack, sd_models, sd_unet, shared
    monkeypatch.setenv("SDACCEL_A1111_GRAPH_ROUTE", "1")   # the route is CUDA-only otherwise
    unet = make_unet()
    inputs = unet_inputs()
    ref = run(unet, inputs)
    ext, _, sd_model = start(fake_a1111, stock_kernels, FakeSdModel(unet))
    sd_hijack.hijack_unet_forward(UNetModel)
    try:
        sd_unet.list_unets()
        assert [o.label for o in sd_unet.unet_options] == ["SD Accel (CUDA graphs)"]
        sd_unet.apply_unet()
        assert sd_unet.current_unet is not None
        out = run(unet, inputs)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        g = ext.host.status(unet)["graphs"]
        assert g["eager"] == 1 and g["last_eager_reason"] == "no CUDA device"
        result = sd_models.reload_model_weights(sd_model.state_dict())   # route off, reload, on again
        assert result.missing_keys == [] and sd_unet.current_unet is not None
        shared.opts.set("sd_accel_cuda_graph", False, is_api=True)
        assert sd_unet.current_unet is None
        torch.testing.assert_close(run(unet, inputs), ref, atol=2e-5, rtol=1e-4)
    finally:
        sd_hijack.undo_unet_forward(UNetModel)


def test_no_unet_route_on_cpu(fake_a1111, stock_kernels, monkeypatch):
    from modules import sd_unet
    monkeypatch.delenv("SDACCEL_A1111_GRAPH_ROUTE", raising=False)
    start(fake_a1111, stock_kernels)
    sd_unet.list_unets()
    assert sd_unet.unet_options == [] or torch.cuda.is_available()


def test_reload_ui_reapplies(fake_a1111, stock_kernels):
    """A1111's "Reload UI": script-unloaded callbacks, callbacks cleared, scripts imported again
    while the model stays loaded."""
    from modules import script_callbacks
    _, _, sd_model = start(fake_a1111, stock_kernels)
    unet = sd_model.model.diffusion_model
    script_callbacks.script_unloaded_callback()
    script_callbacks.clear_callbacks()
    assert fused_count(unet) == 0
    load_extension_script()
    assert fused_count(unet) == 42


def test_precision_setting_is_a_choice_and_says_why_fp8_is_not_used(fake_a1111, stock_kernels, capsys):
    """`sd_accel_precision`: fp16 (default) or fp8 (LOSSY), a radio of those two; on this CPU fp8 is refused with
    its reason in the console and the status route, and the UNet stays as with fp16."""
    from modules import script_callbacks, shared
    unet = make_unet()
    inputs = unet_inputs()
    ext, api_model, _ = start(fake_a1111, stock_kernels, FakeSdModel(unet))
    info = shared.opts.data_labels["sd_accel_precision"]
    assert info.default == "fp16" and info.component_args == {"choices": ["fp16", "fp8"]}
    assert "LOSSY" in info.label and info.section == ("sd_accel", "SD Accel")
    assert shared.api_get_options(api_model)["sd_accel_precision"] == "fp16"
    ref = run(unet, inputs)
    capsys.readouterr()
    assert shared.opts.set("sd_accel_precision", "fp8", is_api=True)
    said = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert "precision fp8 not used: FP8 compute needs an Ada or Hopper GPU" in said, said
        routes = {}
        script_callbacks.app_started_callback(None, type("App", (), {
            "add_api_route": lambda self, path, fn, methods: routes.__setitem__(path, fn)})())
        s = routes["/sd_accel/status"]()
        assert s["options"]["precision"] == "fp8" and s["precision"] == "fp16"
        assert "sm_89/sm_90" in s["reasons"]["precision fp8"]
        assert torch.equal(run(unet, inputs), ref)
    shared.opts.data["sd_accel_precision"] = "int4"     # a value from another version's config.json
    assert ext.webui.options_from(shared.opts).precision == "fp16"
