"""Stand-in for Forge's `backend.operations`: the module classes Forge builds its UNet with.

* `Linear` is a plain `nn.Module` (not an `nn.Linear`) with `in_features`/`out_features`; its weight and
  bias are Parameters once loaded; its forward casts them to the input's device and dtype when
  `parameters_manual_cast` is set (low-precision storage, or the lowvram swap) and merges an online LoRA
  (`forge_online_loras`) per call.
* `GroupNorm`/`LayerNorm`/`Conv2d` are subclasses of torch's with `parameters_manual_cast`, cast the same way.
* `using_forge_operations()` makes `torch.nn.<Op>` these classes while a model is built, as Forge does.
"""
import contextlib

import torch
import torch.nn.functional as F

manual_cast_default = False


def _cast(layer, x):
    w, b = layer.weight, layer.bias
    if getattr(layer, "parameters_manual_cast", False):
        w = None if w is None else w.to(device=x.device, dtype=x.dtype)
        b = None if b is None else b.to(device=x.device, dtype=x.dtype)
    loras = getattr(layer, "forge_online_loras", None)
    if loras:
        if "weight" in loras:
            w = w + sum(loras["weight"]).to(w)
        if "bias" in loras and b is not None:
            b = b + sum(loras["bias"]).to(b)
    return w, b


class Linear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, **kwargs):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -in_features ** -0.5, in_features ** -0.5)
        self.parameters_manual_cast = manual_cast_default

    def forward(self, x):
        return F.linear(x, *_cast(self, x))


class GroupNorm(torch.nn.GroupNorm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parameters_manual_cast = manual_cast_default

    def forward(self, x):
        if self.parameters_manual_cast or getattr(self, "forge_online_loras", None):
            return F.group_norm(x, self.num_groups, *_cast(self, x), self.eps)
        return super().forward(x)


class LayerNorm(torch.nn.LayerNorm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parameters_manual_cast = manual_cast_default

    def forward(self, x):
        if self.parameters_manual_cast or getattr(self, "forge_online_loras", None):
            return F.layer_norm(x, self.normalized_shape, *_cast(self, x), self.eps)
        return super().forward(x)


class Conv2d(torch.nn.Conv2d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parameters_manual_cast = manual_cast_default

    def forward(self, x):
        if self.parameters_manual_cast or getattr(self, "forge_online_loras", None):
            return self._conv_forward(x, *_cast(self, x))
        return super().forward(x)


@contextlib.contextmanager
def using_forge_operations(manual_cast=False):
    global manual_cast_default
    names = ("Linear", "GroupNorm", "LayerNorm", "Conv2d")
    saved = {n: getattr(torch.nn, n) for n in names}
    manual_cast_default = manual_cast
    try:
        for n in names:
            setattr(torch.nn, n, globals()[n])
        yield
    finally:
        for n, c in saved.items():
            setattr(torch.nn, n, c)
        manual_cast_default = False
