"""A1111's hypernetworks and attention settings in what a captured step's graphs are checked against
(hosts/a1111_graph_route.host_state).

A hypernetwork's layers run inside the UNet's cross-attention, so a graph bakes in each layer's multiplier and reads its
weights by address. The stand-in has the shape of A1111 v1.10's modules/hypernetworks/hypernetwork.py: a
`Hypernetwork` with `layers = {size: (HypernetworkModule, HypernetworkModule)}`, `set_multiplier` setting the
prompt's strength on each layer (the class attribute is the default), `load_hypernetworks` keeping only the
ones the prompt names and loading the others anew."""
import sys
import types

import pytest
import torch

from sd_accel.hosts import a1111, a1111_graph_route


class HypernetworkModule(torch.nn.Module):
    multiplier = 1.0

    def __init__(self, dim):
        super().__init__()
        self.linear = torch.nn.Sequential(torch.nn.Linear(dim, dim * 2), torch.nn.Linear(dim * 2, dim))

    def forward(self, x):
        return x + self.linear(x) * self.multiplier


class Hypernetwork:
    def __init__(self, name):
        self.name = name
        self.layers = {size: (HypernetworkModule(size), HypernetworkModule(size)) for size in (8, 16)}

    def set_multiplier(self, multiplier):
        for layers in self.layers.values():
            for layer in layers:
                layer.multiplier = multiplier
        return self


@pytest.fixture
def shared(monkeypatch):
    mod = types.SimpleNamespace(opts=types.SimpleNamespace(lora_functional=False), loaded_hypernetworks=[])
    monkeypatch.setitem(sys.modules, "modules.shared", mod)
    return mod


def load_hypernetworks(shared, names, multipliers):
    """A1111's: the named ones already loaded are kept, the others are loaded anew; then each gets its strength."""
    kept = {h.name: h for h in shared.loaded_hypernetworks if h.name in names}
    shared.loaded_hypernetworks.clear()
    for name, m in zip(names, multipliers):
        shared.loaded_hypernetworks.append((kept.get(name) or Hypernetwork(name)).set_multiplier(m))


def state(unet, st):
    return a1111_graph_route.host_state(unet, st)


@pytest.fixture
def unet_state():
    unet = torch.nn.Linear(2, 2)
    return unet, a1111._state(unet)


def test_the_same_hypernetwork_at_the_same_strength_keeps_the_graphs(shared, unet_state):
    load_hypernetworks(shared, ["foo"], [0.5])
    before = state(*unet_state)
    load_hypernetworks(shared, ["foo"], [0.5])
    assert state(*unet_state) == before


def test_a_strength_change_is_seen(shared, unet_state):
    """The strength lives on the layers (the Hypernetwork object has no multiplier of its own)."""
    load_hypernetworks(shared, ["foo"], [0.5])
    before = state(*unet_state)
    load_hypernetworks(shared, ["foo"], [1.0])
    assert state(*unet_state) != before


def test_a_hypernetwork_loaded_again_after_a_prompt_without_it_is_seen(shared, unet_state):
    """Same name, same strength, but a new object whose weights are elsewhere: a graph of the old one would read
    freed memory."""
    load_hypernetworks(shared, ["foo"], [1.0])
    first = shared.loaded_hypernetworks[0]
    before = state(*unet_state)
    load_hypernetworks(shared, [], [])
    load_hypernetworks(shared, ["foo"], [1.0])
    assert shared.loaded_hypernetworks[0] is not first
    assert state(*unet_state) != before


def test_its_layers_moved_are_seen(shared, unet_state):
    load_hypernetworks(shared, ["foo"], [1.0])
    before = state(*unet_state)
    for layers in shared.loaded_hypernetworks[0].layers.values():
        for layer in layers:
            layer.to(torch.float64)      # the same Parameter objects, new storage
    assert state(*unet_state) != before


def test_an_attention_setting_change_is_seen(shared, unet_state):
    """A1111's attention functions read `upcast_attn` (and the sub-quadratic chunk sizes) on every call."""
    before = state(*unet_state)
    shared.opts.upcast_attn = True
    assert state(*unet_state) != before
