"""SD Accel for AUTOMATIC1111 WebUI (and Forge): settings, callbacks, the CUDA-graph UNet option.

A1111 imports every `extensions/<name>/scripts/*.py` as a plain module, with the extension folder on
sys.path for the duration of the import, where generic names (`engine`, `hosts`, `kernels`) could
collide with other extensions. So the extension folder is loaded as a package under a name unique to
its path, `sd_accel_ext_<hash>`, without running its ComfyUI entry point (`__init__.py`), and the
host adapter is imported from it. Nothing is downloaded and no environment variable is changed.

Settings (section "SD Accel", keys `sd_accel_*`) are registered when this file is imported, so
`GET /sdapi/v1/options` lists them even with `--nowebui` (A1111 builds the API's options model
before `on_ui_settings` runs there), and again in `on_ui_settings` (idempotent).
Guarded: an error here is logged and A1111's start-up goes on.
"""
import hashlib
import importlib
import importlib.util
import logging
import os
import sys

log = logging.getLogger("sd_accel")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PKG = "sd_accel_ext_" + hashlib.sha1(_ROOT.encode("utf-8")).hexdigest()[:10]


def _load_package():
    """The extension folder as the package `_PKG` (its `__init__.py` is ComfyUI's entry: not run)."""
    pkg = sys.modules.get(_PKG)
    if pkg is None:
        spec = importlib.util.spec_from_loader(_PKG, loader=None, is_package=True)
        spec.submodule_search_locations = [_ROOT]
        pkg = importlib.util.module_from_spec(spec)
        pkg.__file__ = os.path.join(_ROOT, "__init__.py")
        sys.modules[_PKG] = pkg
    return importlib.import_module(_PKG + ".hosts.a1111")


host = None
try:
    from modules import script_callbacks, scripts, shared
    host = _load_package()
except Exception as _e:  # noqa: BLE001 - never break the host's start-up
    log.error("[SD Accel] not loaded: %s: %s", type(_e).__name__, _e)
    print("[SD Accel] not loaded: %s: %s" % (type(_e).__name__, _e), file=sys.stderr)


def _loaded_model():
    """The loaded SD model, or None; never triggers a load (unlike `shared.sd_model`)."""
    try:
        from modules import sd_models
        return sd_models.model_data.sd_model
    except Exception:  # noqa: BLE001
        return None


def _options():
    return host.options_from(shared.opts)


def _sync(reason):
    sd_model = _loaded_model()
    if sd_model is None:
        return None
    s = host.sync(sd_model, _options(), reason)
    print("[SD Accel] %s: %d modules patched %s, channels_last %s, state_dict keys unchanged %s"
          % (reason, s.get("patched", 0), s.get("counts", {}), s.get("channels_last"),
             s.get("state_dict_keys_unchanged")))
    return s


def _on_setting_change():
    _sync("settings changed")
    try:   # (de)activate the CUDA-graph UNet route now, not at the next generation
        from modules import sd_unet
        if _loaded_model() is not None and host.unet_of(_loaded_model()) is not None:
            sd_unet.apply_unet()
    except Exception as e:  # noqa: BLE001
        log.warning("[SD Accel] sd_unet.apply_unet: %s", e)


def _section():
    out = {}
    for name, label, info in host.SETTINGS:
        default = getattr(host.A1111Options, name)
        out[host.setting_key(name)] = shared.OptionInfo(default, label, onchange=_on_setting_change).info(info)
    return shared.options_section(host.SECTION, out)


def _register_options():
    section = _section()
    shared.options_templates.update(section)
    for key, info in section.items():
        shared.opts.add_option(key, info)   # keeps a value loaded from config.json


def _on_model_loaded(sd_model):
    if host.is_forge(sd_model):
        return   # Forge: per sampling run, in Script.process_before_every_sampling
    _sync("model loaded")


def _on_script_unloaded():
    sd_model = _loaded_model()
    unet = host.unet_of(sd_model)
    if unet is not None:
        n = host.remove(unet)
        print("[SD Accel] script unloaded: %d original modules restored" % n)


def _original_forward(unet):
    from modules import sd_hijack
    if type(unet).__module__.startswith("sgm."):
        return sd_hijack.sgm_original_forward
    return sd_hijack.ldm_original_forward


def _graph_route_wanted():
    import torch
    return torch.cuda.is_available() or os.environ.get("SDACCEL_A1111_GRAPH_ROUTE") == "1"


def _on_list_unets(unet_list):
    if not _graph_route_wanted():
        return   # CUDA graphs are CUDA-only: no UNet option on a CPU-only install
    from modules import sd_unet
    unet_list.append(host.make_unet_option(sd_unet, _loaded_model, _options, _original_forward))


def _on_app_started(demo, app):
    def sd_accel_status():
        sd_model = _loaded_model()
        s = dict(host.status(host.unet_of(sd_model)))
        s["options"] = _options().__dict__
        s["forge"] = host.is_forge(sd_model)
        s["kernels"] = host.kernel_summary()
        try:
            from modules import sd_unet
            cur = sd_unet.current_unet_option
            s["unet_option"] = getattr(cur, "label", None)
        except Exception:  # noqa: BLE001
            pass
        return s
    app.add_api_route("/sd_accel/status", sd_accel_status, methods=["GET"])


if host is not None:
    try:
        _register_options()
        script_callbacks.on_ui_settings(_register_options)
        script_callbacks.on_model_loaded(_on_model_loaded)
        script_callbacks.on_script_unloaded(_on_script_unloaded)
        script_callbacks.on_list_unets(_on_list_unets)
        script_callbacks.on_app_started(_on_app_started)
        if _loaded_model() is not None:   # "Reload UI": the unload callback restored the modules
            _sync("script reloaded")
    except Exception as _e:  # noqa: BLE001
        log.error("[SD Accel] callbacks not registered: %s: %s", type(_e).__name__, _e)
        print("[SD Accel] callbacks not registered: %s: %s" % (type(_e).__name__, _e), file=sys.stderr)

    class SDAccelScript(scripts.Script):
        """No UI: marks each sampling run for the CUDA-graph fingerprint (A1111), and on Forge
        applies SD Accel to the run's UNet patcher."""

        def title(self):
            return "SD Accel"

        def show(self, is_img2img):
            return scripts.AlwaysVisible

        def process(self, p, *args):
            host.new_sampling_run(p.sd_model)

        def process_before_every_sampling(self, p, *args, **kwargs):   # Forge only
            if not host.is_forge(p.sd_model):
                return
            opts = _options()
            if not opts.enabled:
                return
            fo = p.sd_model.forge_objects
            fo.unet, info = host.forge_accelerate(fo.unet, opts)
            log.info("[SD Accel] Forge: %s", info)
