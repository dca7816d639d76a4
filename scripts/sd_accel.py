"""SD Accel for AUTOMATIC1111 WebUI and WebUI Forge: settings, callbacks, the status route.

A1111 (and Forge) imports every `extensions/<name>/scripts/*.py` as a plain module, with the extension
folder on sys.path for the duration of the import, where generic names (`engine`, `hosts`, `kernels`) could
collide with other extensions. So the extension folder is loaded as a package under a name unique to its
path, `sd_accel_ext_<hash>`, without running its ComfyUI entry point (`__init__.py`), and the host
adapters are imported from it: hosts/a1111.py (A1111: modules swapped in the loaded UNet) and
hosts/forge.py (Forge: object patches on the run's UNet patcher). Nothing is downloaded and no environment
variable is changed.

Settings (section "SD Accel" in the "Stable Diffusion" category, beside "Optimizations"; keys
`sd_accel_*`) are registered when this file is imported and again in `on_ui_settings` (idempotent). The
API's options model (`modules.api.models.OptionsModel`, the response model of `GET /sdapi/v1/options`) is
built from the registered options when that module is first imported; where it was imported before this
file (Forge's built-in ControlNet does), it is extended with ours, built from the same option data.
Guarded: an error here is logged and the WebUI's start-up goes on.
"""
import hashlib
import importlib
import importlib.util
import inspect
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
    return tuple(importlib.import_module(_PKG + ".hosts." + n)
                 for n in ("webui", "a1111", "a1111_graph_route", "forge"))


def _running_in_forge():
    """Forge ships its `modules_forge` package beside `modules`; A1111 has none."""
    if "modules_forge" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("modules_forge") is not None
    except (ImportError, ValueError):
        return False


host = webui = graph_route = forge = None
IS_FORGE = _running_in_forge()
try:
    from modules import script_callbacks, scripts, shared
    webui, host, graph_route, forge = _load_package()
except Exception as _e:  # noqa: BLE001 - never break the host's start-up
    log.error("[SD Accel] not loaded: %s: %s", type(_e).__name__, _e)
    print("[SD Accel] not loaded: %s: %s" % (type(_e).__name__, _e), file=sys.stderr)


def _say(line):
    print("[SD Accel] " + line)


def _loaded_model():
    """The loaded SD model, or None; never triggers a load (unlike `shared.sd_model`)."""
    try:
        from modules import sd_models
        return sd_models.model_data.sd_model
    except Exception:  # noqa: BLE001
        return None


def _options():
    return webui.options_from(shared.opts)


def _describe(s):
    return "%d modules %s" % (s.get("patched", 0), s.get("counts", {}))


def _sync(reason):
    sd_model = _loaded_model()
    if sd_model is None:
        return None
    if IS_FORGE:
        s = forge.prepare(sd_model, _options())
        if s is not None:
            _say("%s (Forge): each generation patches %s; CUDA graphs %s, channels_last %s" % (
                reason, _describe(s), "on" if _options().want("cuda_graph") else "off",
                "on" if _options().want("channels_last") else "off"))
            for what, why in s.get("reasons", {}).items():
                _say("%s not used: %s" % (what, why))
        return s
    s = host.sync(sd_model, _options(), reason)
    _say("%s: %s patched, precision %s, channels_last %s, state_dict keys unchanged %s"
         % (reason, _describe(s), s["precision"] + (" (LOSSY)" if s["precision"] == "fp8" else ""),
            "on" if s["channels_last"] else "off", s["state_dict_keys_unchanged"]))
    for what, why in s["reasons"].items():
        _say("%s not used: %s" % (what, why))
    return s


def _on_setting_change():
    _sync("settings changed")
    if IS_FORGE:
        return
    try:   # (de)activate the CUDA-graph UNet route now, not at the next generation
        from modules import sd_unet
        if host.unet_of(_loaded_model()) is not None:
            sd_unet.apply_unet()
    except Exception as e:  # noqa: BLE001
        log.warning("[SD Accel] sd_unet.apply_unet: %s", e)


def _section_id():
    """(id, title, category) where the WebUI files sections by category (A1111 1.6+, Forge); else (id, title)."""
    if "category_id" in inspect.signature(shared.OptionInfo).parameters:
        return webui.SECTION + (webui.CATEGORY,)
    return webui.SECTION


def _radio():
    """gradio's Radio (the WebUI's own UI library), or None where it cannot be imported (a default component)."""
    try:
        import gradio
        return gradio.Radio
    except ImportError:
        return None


def _section():
    out = {}
    for name, label, info in webui.SETTINGS:
        default = getattr(webui.WebUIOptions, name)
        if name in webui.CHOICES:
            option = shared.OptionInfo(default, label, _radio(), {"choices": list(webui.CHOICES[name])},
                                       onchange=_on_setting_change)
        else:
            option = shared.OptionInfo(default, label, onchange=_on_setting_change)
        out[webui.setting_key(name)] = option.info(info)
    return shared.options_section(_section_id(), out)


def _extend_api_options_model(section):
    """Adds our options to the API's options model when it was built before they were registered."""
    models = sys.modules.get("modules.api.models")
    model = getattr(models, "OptionsModel", None)
    if model is None:
        return 0   # not built yet: it will be built from the registered options, ours included
    known = model.model_fields if hasattr(model, "model_fields") else model.__fields__   # pydantic 2 / 1
    missing = {k: v for k, v in section.items() if k not in known}
    if not missing:
        return 0
    from typing import Optional
    # the API module's own pydantic names (it imports create_model and Field from pydantic)
    create_model, field = models.create_model, models.Field
    fields = {k: (Optional[type(v.default)], field(default=v.default, description=v.label)) for k, v in missing.items()}
    models.OptionsModel = create_model("Options", __base__=model, **fields)
    return len(missing)


def _register_options():
    section = _section()
    shared.options_templates.update(section)
    for key, info in section.items():
        shared.opts.add_option(key, info)   # keeps a value loaded from config.json
    _extend_api_options_model(section)


def _on_model_loaded(sd_model):
    _sync("model loaded")


def _on_script_unloaded():
    unet = None if IS_FORGE else host.unet_of(_loaded_model())
    if unet is not None:
        _say("script unloaded: %d original modules restored" % host.remove(unet))


def _original_forward(unet):
    from modules import sd_hijack
    if type(unet).__module__.startswith("sgm."):
        return sd_hijack.sgm_original_forward
    return sd_hijack.ldm_original_forward


def _graph_route_wanted():
    import torch
    return torch.cuda.is_available() or os.environ.get("SDACCEL_A1111_GRAPH_ROUTE") == "1"


def _on_list_unets(unet_list):
    if IS_FORGE or not _graph_route_wanted():
        return   # CUDA graphs are CUDA-only: no UNet option on a CPU-only install; Forge: its own wrapper
    from modules import sd_unet
    unet_list.append(graph_route.make_unet_option(sd_unet, _loaded_model, _options, _original_forward))


def _settings_place():
    """Where the WebUI files our settings: section title and category label."""
    info = shared.opts.data_labels.get(webui.setting_key("enabled"))
    place = {"section": getattr(info, "section", (None, None))[1], "category": None}
    try:
        from modules.options import categories
        cat = categories.mapping.get(getattr(info, "category_id", None))
        place["category"] = getattr(cat, "label", None)
    except Exception:  # noqa: BLE001 - a WebUI without categories
        pass
    return place


def _status():
    sd_model = _loaded_model()
    if IS_FORGE:
        s = forge.status(sd_model)
    else:
        s = dict(host.status(host.unet_of(sd_model)))
        try:
            from modules import sd_unet
            s["unet_option"] = getattr(sd_unet.current_unet_option, "label", None)
        except Exception:  # noqa: BLE001
            pass
    s["options"] = _options().__dict__
    s["forge"] = IS_FORGE
    s["kernels"] = webui.kernel_summary()
    s["settings"] = _settings_place()
    return s


def _on_app_started(demo, app):
    app.add_api_route("/sd_accel/status", _status, methods=["GET"])


if host is not None:
    try:
        _register_options()
        script_callbacks.on_ui_settings(_register_options)
        script_callbacks.on_model_loaded(_on_model_loaded)
        script_callbacks.on_script_unloaded(_on_script_unloaded)
        script_callbacks.on_list_unets(_on_list_unets)
        script_callbacks.on_app_started(_on_app_started)
        if _loaded_model() is not None and not IS_FORGE:   # "Reload UI": the unload callback restored them
            _sync("script reloaded")
    except Exception as _e:  # noqa: BLE001
        log.error("[SD Accel] callbacks not registered: %s: %s", type(_e).__name__, _e)
        print("[SD Accel] callbacks not registered: %s: %s" % (type(_e).__name__, _e), file=sys.stderr)

    class SDAccelScript(scripts.Script):
        """No UI: marks each sampling run for the CUDA-graph fingerprint (A1111), and on Forge applies
        SD Accel to the run's UNet patcher."""

        def title(self):
            return "SD Accel"

        def show(self, is_img2img):
            return scripts.AlwaysVisible

        def process(self, p, *args):
            if not IS_FORGE:
                host.new_sampling_run(p.sd_model)

        def process_before_every_sampling(self, p, *args, **kwargs):   # Forge only
            if not IS_FORGE:
                return
            fo = p.sd_model.forge_objects
            opts = _options()
            if not opts.enabled:
                fo.unet = forge.strip(fo.unet)
                return
            fo.unet, info = forge.accelerate(fo.unet, opts)
            log.info("[SD Accel] Forge run: %s patched (%s), wrapper %s, CUDA graphs %s", _describe(info),
                     "SiLU folded" if info["fold_silu"] else "SiLU not folded: group_norm_wrapper set",
                     info["wrapper"] or "none", "on" if info["cuda_graph"] else "off")
