"""One UNet plan per model and inputs: clones of one model that would get the same module swaps get the same objects.

Each Accelerated KSampler input (the checkpoint's model, a FreeU clone of it, a PAG clone...) gets its own accelerated
clone, with SD Accel's folded copies of the UNet's blocks as object patches (object_patches.py). The graphs' weights
fingerprint reads the module tree by identity (engine/graphs/fingerprint.py): were those copies made per clone, every
switch between two clones, however alike, would read as a new model and drop every graph. A graph whose samplers run
two clones of one checkpoint (FreeU on the base pass and not on the hires pass, say) would capture both passes again
on every prompt, and a user tweaking a patch node would lose the graphs of the passes they did not touch. So a clone
whose plan would be made from the same inputs gets the plan already made: the same module objects, one tree, and the
other clone's graphs stay valid (they read the same tensors; what differs between the clones, their patches and
wrappers, is in each call's graph key) and replay.

The inputs, all in the key: the options that shape the plan; the UNet module; other packs' object patches on the
clone (path and object); and every module of each top-level block as the clone will find it (object_patches'
`_unpatched`), by identity, class, an instance `forward` and hook counts: a pack that swapped or hooked a module
inside a block since gets a new plan. Objects are held weakly (engine/graphs/tokens.Token): a key
whose module died never matches again. Not reused: plans with derived weight copies (FP8, upcast copies of
fp8-stored weights: kept here they would outlive the clone that made them, VRAM included), plans made with another
clone's injections ejected, and other planners (a ControlNet's, a VAE's).
"""
from collections import OrderedDict

from torch import nn

from ...engine.graphs.tokens import Token
from ...engine.patches import patching
from ..attached import state_on

_ATTR = "_sd_accel_plans"
MAX_PLANS = 4   # per model: the options combinations in use at once (a user's graph has a few)


def _module_marks(module):
    if not isinstance(module, nn.Module):   # another pack's object standing for a block: by identity
        return ((Token(module), type(module)),)
    return tuple((Token(m), type(m), "forward" in vars(m), len(m._forward_hooks), len(m._forward_pre_hooks))
                 for m in module.modules())


def key(clone, root, flags, unpatched, foreign):
    """The plan's inputs (module doc) as a hashable key. `flags`: the options that shape the plan; `unpatched(clone,
    path)`: a top-level block as the clone will find it; `foreign`: other packs' (path, object) patches on it."""
    live = patching.get_attr(clone.model, root)
    blocks = tuple((name, _module_marks(unpatched(clone, root + "." + name))) for name in live._modules)
    return (root, flags, Token(live), tuple((path, Token(obj)) for path, obj in foreign), blocks)


def _plans(model):
    return state_on(model, _ATTR, OrderedDict)


def find(model, plan_key):
    """(patches, counts) planned earlier on `model` for `plan_key` (copies of the dicts, the same modules), or None."""
    plans = _plans(model)
    found = plans.get(plan_key)
    if found is None:
        return None
    plans.move_to_end(plan_key)
    return dict(found[0]), dict(found[1])


def keep(model, plan_key, patches, counts):
    """Keeps the plan for `plan_key` on `model`, the MAX_PLANS used last (a key whose module died never matches again;
    the bound frees it)."""
    plans = _plans(model)
    plans[plan_key] = (dict(patches), dict(counts))
    while len(plans) > MAX_PLANS:
        plans.popitem(last=False)
