"""A stand-in for A1111's built-in Lora extension (`extensions-builtin/Lora/networks.py`, imported as the top-level
module `networks`), as far as a layer's forward sees it; written from its documented behaviour, no A1111 code.

* `install(root)` names every Linear under `root` (`network_layer_name`, as the extension names the loaded model's
  modules) and replaces `torch.nn.Linear.forward` with the extension's: in its default mode it first writes the wanted
  networks into the module's weight in place (`network_apply_weights`: when the wanted names differ from the
  module's `network_current_names`, restore the weight from `network_weights_backup`, made on the first change, then
  add each network's delta), then runs torch's forward; with `opts.lora_functional` on it restores the weight and
  adds each network's output to the layer's instead.
* `loaded_networks` is the list the extension fills before a generation: `Network(name, deltas, multiplier)`,
  `deltas` {layer name: weight delta}.
"""
import sys
import types

import torch
import torch.nn.functional as F

loaded_networks = []
_original_linear_forward = None
opts = types.SimpleNamespace(lora_functional=False)


class Network:
    def __init__(self, name, deltas, multiplier=1.0):
        self.name, self.deltas = name, deltas
        self.te_multiplier = self.unet_multiplier = multiplier
        self.dyn_dim = None


def _wanted():
    return tuple((n.name, n.te_multiplier, n.unet_multiplier, n.dyn_dim) for n in loaded_networks)


def _restore(module):
    backup = getattr(module, "network_weights_backup", None)
    if backup is not None:
        with torch.no_grad():
            module.weight.copy_(backup)


def network_apply_weights(module):
    name = getattr(module, "network_layer_name", None)
    wanted = _wanted()
    if name is None or getattr(module, "network_current_names", ()) == wanted:
        return
    with torch.no_grad():
        if getattr(module, "network_weights_backup", None) is None and wanted:
            module.network_weights_backup = module.weight.detach().to("cpu", copy=True)
        _restore(module)
        for net in loaded_networks:
            delta = net.deltas.get(name)
            if delta is not None:
                module.weight.copy_((module.weight.float() + net.unet_multiplier * delta.float()).to(module.weight.dtype))
    module.network_current_names = wanted


def network_forward(module, x):
    _restore(module)
    module.network_current_names = ()
    y = _original_linear_forward(module, x)
    for net in loaded_networks:
        delta = net.deltas.get(getattr(module, "network_layer_name", None))
        if delta is not None:
            y = y + F.linear(x, (net.unet_multiplier * delta).to(x.dtype))
    return y


def network_Linear_forward(self, x):
    if opts.lora_functional:
        return network_forward(self, x)
    network_apply_weights(self)
    return _original_linear_forward(self, x)


def install(root, monkeypatch):
    """The extension's patch of torch's Linear and its names on `root`'s Linears; `monkeypatch` undoes both, and
    makes this module `networks` with `modules.shared.opts` reading `lora_functional` from `opts`."""
    global _original_linear_forward
    _original_linear_forward = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", network_Linear_forward)
    # A1111 imports the extension before SD Accel first plans a module of the class: the host forward SD Accel
    # records for Linear is the extension's (engine/patches/fused_modules.host_forwards)
    from sd_accel.engine.patches import fused_modules
    monkeypatch.setitem(fused_modules._host_forwards, torch.nn.Linear, None)
    del fused_modules._host_forwards[torch.nn.Linear]
    me = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "networks", me)
    monkeypatch.setitem(sys.modules, "modules.shared", types.SimpleNamespace(opts=opts, loaded_hypernetworks=[]))
    monkeypatch.setattr(me, "loaded_networks", [])
    monkeypatch.setattr(opts, "lora_functional", False)
    for name, m in root.named_modules():
        if isinstance(m, torch.nn.Linear):
            monkeypatch.setattr(m, "network_layer_name", name, raising=False)
    return me
