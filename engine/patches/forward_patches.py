"""Stand-ins that replace a module's forward, not the module: for the Linear and Conv2d layers whose own weights the
host patches (LoRA, fp8 storage, low-VRAM casting).

A module stand-in (fused_modules.clone_as) is a second object at the module's path, with its own instance state.
For a layer whose weights the host patches, that state diverges: ComfyUI marks each module it has patched
(`comfy_patched_weights`) and skips it on the next load of a clone with the same patches; a mark left on the
object that was out of the tree while the other's weights were restored makes a later load skip patching a LoRA in
(the image of another strength, or none), and a parameter table of planning time keeps another clone's LoRA or a
CPU copy. A forward patch is set as the module's own `forward` attribute (an object patch at `<path>.forward`), so
the host's module stays in the tree with its parameters, marks and casting, and the patch reads them at each call.
"""
import weakref

from . import fused_modules as fm
from . import stock_path

ATTR = "forward"


class ForwardPatch:
    """Callable set as `module.forward`. Subclasses define `sdaccel_kind` and `compute(x)` (None: the host's
    forward runs). Outside `stock_path.stock_modules()` (or inside it where `on_stock_path`), with no extra arguments
    and no other pack's forward on the host class, `compute` decides; otherwise the host class's forward runs, as
    stock would."""
    sdaccel_kind = None
    # True for a patch that computes exactly the host's values for less than the host's forward costs even
    # without graphs (fp8-stored weights upcast once instead of at every call): it stays on the stock path too
    on_stock_path = False

    def __init__(self, module):
        # weakly: set as the module's own `forward`, a strong reference would be a cycle (module -> patch -> module)
        # that keeps the layer and its weights, in VRAM, until a garbage collection runs (ComfyUI leaves a loaded
        # model's object patches applied when the user's graph drops it and its patcher is freed)
        self._module = weakref.ref(module)
        fm.host_forwards(type(module))     # the class's forwards as of now, for class_forward_replaced

    @property
    def module(self):
        return self._module()

    def host_forward(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)

    def compute(self, x):
        raise NotImplementedError

    def __call__(self, x, *args, **kwargs):
        if (stock_path.LOCAL.depth and not self.on_stock_path) or stock_path.compiling() or args or kwargs or \
                fm.class_forward_replaced(type(self.module)):
            return self.host_forward(x, *args, **kwargs)
        out = self.compute(x)
        return self.host_forward(x) if out is None else out


def is_forward_patch(value):
    return isinstance(value, ForwardPatch)


def path_of(module_path):
    """The object-patch path of a forward patch for the module at `module_path`."""
    return module_path + "." + ATTR
