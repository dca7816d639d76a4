"""Stand-in of A1111's built-in HyperTile (extensions-builtin/hypertile, imported as the top-level module `hypertile`):
once enabled, every self-attention it tiles gets a wrapper as its own `forward` for good, with its parameters on the
module (`__webui_hypertile_params`); each generation sets `enabled` and the tile size there. Enabled, the wrapper
splits the tokens into tiles (here: always two along the rows) around the layer's forward; switched off, it calls
that forward unchanged."""
import functools
import types


def hook(module):
    params = types.SimpleNamespace(enabled=True, forward=module.forward)
    module.__dict__["__webui_hypertile_params"] = params

    @functools.wraps(params.forward)
    def wrapper(x, *args, **kwargs):
        if not params.enabled or x.shape[1] % 2:
            return params.forward(x, *args, **kwargs)
        b, n, c = x.shape
        out = params.forward(x.reshape(b * 2, n // 2, c), *args, **kwargs)
        return out.reshape(b, n, c)
    module.forward = wrapper
    return params
