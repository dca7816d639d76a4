"""On the stock path, a UNet's folded blocks swapped back for the originals they were copied from.

An eager call that runs the stock modules (engine/graphs/eager.py) still goes through each stand-in, whose stock
branch is a Python frame and a few checks before the host's own forward: a few µs each, hundreds of them in SDXL's
UNet, about a millisecond of host time per call (bench/RESULTS.md, session 36). A call bound by the host pays all
of it (a batch-1 pass, as PerturbedAttentionGuidance's; a step that waits for a GPU value, as EasyCache's), and
that made SDXL with those patches slower than stock without graphs. A folded block (object_patches.py) shares every
tensor and untouched module with its original, which is never modified, so for that call the original can sit in
the tree instead: stock's modules themselves, as stock runs them.

Only where the copy computes nothing the original does not. Module by module down the copy's own (not shared)
modules, each must be the original's class with the original's parameter and buffer tables, and no attribute of
its own but SD Accel's: a stand-in, a copy made to reach one (patch_folding.own_copy), or a SiLU folded into the
GroupNorm before it. Anything else keeps the copy, as before:
  * another pack's object patch set inside the block after Apply SD Accel (ComfyUI sets it in our copy);
  * the host's per-load state on a stand-in only (low-VRAM casting: `comfy_cast_weights`, `weight_function`);
  * a forward or hook another pack set on one of our modules.
Decided once per sampling run (the run's `sample_sigmas`, current ComfyUI, where blocks are folded), at its first
call on the stock path: loads, and with them object patches and low-VRAM state, happen between runs.

The tree is the model's, not the thread's: while a call runs here, another thread calling the same UNet would run
stock's modules too (the same values; ComfyUI runs one prompt at a time).
"""
import contextlib
import weakref

from torch import nn

from ...engine.patches import fused_modules as fm
from . import object_patches

_OURS = ("sdaccel_mixin", "_sdaccel_host_impl", object_patches._BASE)
_PLAIN = (int, float, bool, str, bytes, type(None))


class StockBlocks:
    """Per loaded UNet: which folded blocks its stock-path calls of the current run swap back."""

    def __init__(self):
        self.run = None        # the sampling run the caller is in (None: never swap)
        self._planned_for = None
        self._swaps = ()       # (name, weakref to the copy, original): a dropped clone's copies are not kept

    def enter_run(self, run):
        """The run the next calls belong to: an object that identifies it (current ComfyUI's `sample_sigmas`),
        or None to keep the copies (a compiled model, another pack's forward on the UNet, no run known)."""
        self.run = run

    def swaps(self, unet):
        if self.run is None:
            return ()
        if self._planned_for is not self.run:
            self._swaps = plan(unet)
            self._planned_for = self.run
        return self._swaps

    @contextlib.contextmanager
    def originals(self, unet):
        """The scope of one stock-path call: the run's swappable blocks replaced by their originals, put back
        after (a nested call finds the originals in place and leaves them to the outer one)."""
        mods = unet._modules
        done = []
        for name, copy_ref, original in self.swaps(unet):
            copy = copy_ref()
            if copy is not None and mods.get(name) is copy:
                mods[name] = original
                done.append((name, copy))
        try:
            yield len(done)
        finally:
            for name, copy in done:
                mods[name] = copy


def for_forward(gf):
    """A ControlNet's forward stand-in (engine/graphs/graphed_forward.py): the scope of its stock-path calls, the
    cldm module's folded blocks swapped back as a UNet's are, planned once per sampling run (the stand-in's
    `epoch`, new for each Accelerated KSampler run; None before the first: never swap)."""
    blocks = StockBlocks()
    ref = weakref.ref(gf)   # held by gf itself: no cycle

    def tree():
        g = ref()
        module = g.module if g is not None else None
        if module is None:
            return contextlib.nullcontext()
        blocks.enter_run(g.epoch)
        return blocks.originals(module)
    return tree


def plan(unet):
    """[(name, weakref to the folded copy, its original)] of `unet`'s top-level blocks whose copy may give
    way (module doc)."""
    out = []
    for name, m in unet._modules.items():
        if object_patches.is_folded(m):
            original = object_patches._original(m)
            if computes_as(m, original):
                out.append((name, weakref.ref(m), original))
    return out


def computes_as(copy, original):
    """True when `copy` (a folded block, or a module below one) computes what `original` does on the stock
    path, by the module doc's rules."""
    if copy is original:
        return True
    if isinstance(copy, fm.SiLUFolded):
        return type(original) is nn.SiLU and not copy._modules
    if type(copy) is not type(original):
        return False
    cd, od = copy.__dict__, original.__dict__
    if cd.get("_parameters") is not od.get("_parameters") or cd.get("_buffers") is not od.get("_buffers"):
        return False
    mixin = cd.get("sdaccel_mixin")
    members = fm.mixin_members(mixin) if mixin is not None else {}
    cls = type(copy)
    for k, v in cd.items():
        w = od.get(k, _MISSING)
        if v is w or k == "_modules" or k in _OURS or k.startswith("sdaccel_"):
            continue
        if w is _MISSING and k in members and _is_member(v, members[k]):
            continue
        # an attribute one of them lacks reads the class's (the host sets `weight_function = []` on the modules
        # in the tree at each load, where its ops classes hold the same empty default)
        if not _same(v, getattr(cls, k, _MISSING) if w is _MISSING else w):
            return False
    for k, w in od.items():
        if k not in cd and k not in _OURS and not k.startswith("sdaccel_") and \
                not _same(getattr(cls, k, _MISSING), w) and not fm.own_method_residue(original, k):
            return False
    cm, om = copy._modules, original._modules
    if list(cm) != list(om):
        return False
    return all(computes_as(cm[n], om[n]) for n in cm)


_MISSING = object()


def _is_member(value, member):
    """`value` is the mixin's `member` as a stand-in holds it (the value itself, or the function bound)."""
    return value is member or getattr(value, "__func__", None) is member


def _same(a, b):
    """Identical, or equal plain values and containers of them (a copied hooks table, an emptied list)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple, dict)) and not a:   # the common case: empty hook tables, emptied lists
        return not b
    if isinstance(a, _PLAIN):
        return a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (set, frozenset)):
        return a == b
    return False
