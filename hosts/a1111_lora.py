"""What A1111's built-in Lora extension does in its own layers' forwards, which SD Accel's replacements bypass.

The extension (`extensions-builtin/Lora`, imported as the top-level module `networks`) replaces the forward of
torch's Linear, Conv2d, GroupNorm and LayerNorm by one that first writes the wanted networks' weights into the
module's own Parameters (`network_apply_weights`: restored from its backup and patched in place, only when the
wanted set differs from the module's `network_current_names`), then computes as before. With the `lora_functional`
option on, the weights stay as loaded and the networks' outputs are added to the layer's instead.
Read lazily from `sys.modules`: nothing here imports A1111.
"""
import sys


def _networks():
    return sys.modules.get("networks")


def functional():
    """True when A1111 adds LoRA outputs per call (`lora_functional`) instead of patching weights."""
    shared = sys.modules.get("modules.shared")
    return bool(getattr(getattr(shared, "opts", None), "lora_functional", False))


def wanted_names():
    """The loaded networks as the extension compares them with a module's `network_current_names`."""
    return tuple((x.name, x.te_multiplier, x.unet_multiplier, getattr(x, "dyn_dim", None))
                 for x in getattr(_networks(), "loaded_networks", ()))


def apply_weights(module):
    """Writes the wanted networks' weights into `module` as the extension's own forward would before computing
    (a no-op without the extension, for a module it did not name, or in functional mode)."""
    fn = getattr(_networks(), "network_apply_weights", None)
    if fn is None or getattr(module, "network_layer_name", None) is None or functional():
        return
    fn(module)
