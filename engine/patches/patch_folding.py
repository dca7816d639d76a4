"""Folds a patch plan into one patch per top-level block, so a host that re-applies patches often pays little.

Current ComfyUI restores and re-applies every object patch of a loaded model at each prompt
(`ModelPatcher.partially_load`: `unpatch_model` then `patch_model`), one `set_attr` down a dotted path each
way. SD1.5's plan is 224 patches (~500 for SDXL): 4.4 ms of every SD1.5 512² prompt on the H200's host, 3%
of its 20 steps. Folded, it is a handful (bench/RESULTS.md: "Where a 512² prompt's time goes outside the
steps" and "Object patches folded").

`fold(patches, bases)` takes the plan as a host would apply it, `{path: module}` in order, each later patch set
through the modules the earlier ones put in place, and returns an equivalent plan with the patches under each
group (a top-level block such as "diffusion_model.input_blocks") replaced by one patch: a copy of the group in
which every planned patch has been applied. Copy on write: the group and each module on a patched path are
shallow copies with a children dict of their own (parameters, buffers and every module off the patched paths
are the originals' own objects), so the original tree is never modified and stays what the host restores.
A planned stand-in that shares its children dict with the module it stands in for (fused_modules._clone_into)
gets a dict of its own (in place) before anything is set under it.

A group is left as it is (its patches returned unfolded) where folding could change what the host would do:
a patch path that does not go through child modules, or a group the caller excludes (the host's own patches of
other packs under it, which the host applies before ours and which a copy made now would not contain).
"""
from collections import OrderedDict

from torch import nn

from . import fused_modules as fm
from . import shared_state


def group_of(path, prefix):
    """The group a patch path belongs to: `prefix` + its first component below the prefix (None if the path
    is not below the prefix or is a group itself)."""
    if not path.startswith(prefix):
        return None
    head, dot, rest = path[len(prefix):].partition(".")
    return prefix + head if dot and rest else None


def own_copy(module):
    """A shallow copy of `module` with a children dict of its own; everything else (parameters, buffers,
    hooks, attributes) is the original's, so weight patches and offloading reach both."""
    new = module.__class__.__new__(module.__class__)
    new.__dict__.update(fm.instance_state(module))
    new.__dict__["_modules"] = dict(module._modules)
    shared_state.link(module, new)   # the host's marks on the shared weights' state, as a stand-in's
    return fm.bind_methods(new)


def fold(patches, bases, prefix, exclude=()):
    """`patches`: ordered {path: replacement}; `bases`: {group path: the group's original module} (the unpatched
    one: a host may have another model's patches applied right now); `prefix`: what every group path starts
    with ("diffusion_model."); `exclude`: group paths never folded. Returns (ordered {path: module}, the group
    paths folded)."""
    by_group = OrderedDict()
    for path, module in patches.items():
        g = group_of(path, prefix)
        by_group.setdefault(g, []).append((path, module))
    out, folded = OrderedDict(), []
    for g, items in by_group.items():
        unit = None
        if g is not None and g not in exclude and len(items) > 1 and g in bases:
            unit = _apply_copy_on_write(bases[g], [(p[len(g) + 1:].split("."), m) for p, m in items])
        if unit is None:
            out.update(items)
        else:
            out[g] = unit
            folded.append(g)
    return out, folded


def copy_with(base, patches):
    """`base` copied on write with every {path: module} of `patches` (paths relative to `base`) set in order, as
    a host applying them one by one would leave it; None where a path does not run through child modules."""
    return _apply_copy_on_write(base, [(path.split("."), m) for path, m in patches.items()])


def _apply_copy_on_write(base, items):
    """`base` copied with every (path parts, module) of `items` set in order, or None where a path does not
    run through child modules."""
    root = own_copy(base)
    owned = {id(root)}
    origin = {id(root): base}     # an owned copy -> the original it copies
    for parts, module in items:
        parent = root
        for name in parts[:-1]:
            child = parent._modules.get(name) if isinstance(parent, nn.Module) else None
            if not isinstance(child, nn.Module):
                return None
            if id(child) not in owned:
                copy = own_copy(child)
                origin[id(copy)] = child
                parent._modules[name] = child = copy
                owned.add(id(child))
            parent = child
        if not isinstance(parent, nn.Module) or not isinstance(module, nn.Module) or parts[-1] not in parent._modules:
            return None
        if module._modules:
            # A planned stand-in shares its children dict with the original it stands in for, so a host
            # applying patch by patch would show it the children set so far under that original (the
            # ResBlocks' fused norms come before the ResBlock stand-ins in the plan): it gets a copy of what
            # stands there now. In place: the plan's object keeps its identity, which
            # engine/patches/emb_projections.py indexes the ResBlocks by.
            here = parent._modules[parts[-1]]
            was = origin.get(id(here), here)
            src = here if module._modules is was._modules else module
            module.__dict__["_modules"] = dict(src._modules)
            owned.add(id(module))
        parent._modules[parts[-1]] = module
    return root
