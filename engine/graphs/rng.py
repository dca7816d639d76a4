"""The random number generators a step may draw from, read and set around a probe call.

A graph replays GPU work only. Draws from the CUDA default generator are fine: torch registers it with every
capture and each replay advances its offset as the eager call would (same numbers as stock). Draws on the
host (torch's CPU generator, Python's `random`, NumPy's global generator) decided once, at capture; a replay
neither draws nor advances them. Such a step is captured only if its result does not depend on those draws
(a probe runs it twice from different host generator states and compares: ComfyUI's HyperTile draws a tile
size from one candidate at SD sizes, for instance).
"""
import random
import sys

import torch


class Snapshot:
    """The generators' states at one moment."""

    def __init__(self):
        self.cpu = torch.default_generator.get_state()
        self.py = random.getstate()
        np = sys.modules.get("numpy")
        self.np = np.random.get_state() if np is not None else None
        self.cuda = _cuda_offset()

    def host_draws_since(self, earlier):
        """True when a host generator moved since `earlier`."""
        if not torch.equal(self.cpu, earlier.cpu) or self.py != earlier.py:
            return True
        return self.np is not None and earlier.np is not None and not _np_equal(self.np, earlier.np)

    def cuda_draws_since(self, earlier):
        return self.cuda != earlier.cuda

    def restore(self, cuda=True):
        torch.default_generator.set_state(self.cpu)
        random.setstate(self.py)
        np = sys.modules.get("numpy")
        if self.np is not None and np is not None:
            np.random.set_state(self.np)
        if cuda and self.cuda is not None:
            torch.cuda.default_generators[self.cuda[0]].set_offset(self.cuda[1])


def perturb_host(seed=0x5DACCE1):
    """Host generators moved to states unrelated to the current ones (CUDA's left alone)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


def _cuda_offset():
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    d = torch.cuda.current_device()
    try:
        return d, torch.cuda.default_generators[d].get_offset()
    except (RuntimeError, AttributeError):
        return None


def _np_equal(a, b):
    np = sys.modules["numpy"]
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])
