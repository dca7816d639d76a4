"""ldm's UNetModel (PyPI's stable-diffusion-sdkit) on a machine without omegaconf: its `__init__` imports omegaconf
only for `isinstance(context_dim, ListConfig)`. The GPU machine has no omegaconf (and its antlr4 dependency has no
wheel to carry), so the A1111 bench and GPU test give ldm that one name. A1111 itself always has the real package."""
import sys
import types


def provide_list_config():
    """Makes `omegaconf.listconfig.ListConfig` importable where omegaconf is not installed (a no-op where it is)."""
    try:
        import omegaconf.listconfig  # noqa: F401
        return
    except ImportError:
        pass
    oc, lc = types.ModuleType("omegaconf"), types.ModuleType("omegaconf.listconfig")
    lc.ListConfig = type("ListConfig", (list,), {})
    oc.listconfig = lc
    sys.modules.update({"omegaconf": oc, "omegaconf.listconfig": lc})
