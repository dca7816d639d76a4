"""ComfyUI node classes, one module per feature. Each module is imported on its own, so a feature whose
optional dependency is missing leaves the others registered and says what is off."""
import importlib
import logging

log = logging.getLogger("sd_accel")

NODE_MODULES = ("sampler_nodes", "controlnet_nodes", "memory_nodes", "vae_nodes", "clip_nodes", "image_nodes")
NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
LOAD_ERRORS = {}

for _name in NODE_MODULES:
    try:
        _mod = importlib.import_module("." + _name, __name__)
    except Exception as e:  # noqa: BLE001 - one broken feature must not take the others down
        LOAD_ERRORS[_name] = "%s: %s" % (type(e).__name__, e)
        log.warning("[SD Accel] nodes.%s not loaded: %s", _name, LOAD_ERRORS[_name])
        continue
    NODE_CLASS_MAPPINGS.update(getattr(_mod, "NODE_CLASS_MAPPINGS", {}))
    NODE_DISPLAY_NAME_MAPPINGS.update(getattr(_mod, "NODE_DISPLAY_NAME_MAPPINGS", {}))
