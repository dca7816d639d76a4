"""Attributes a host keeps on a module about the state of its weights, shared between the module and its stand-ins.

A stand-in shares its module's parameter dict (engine/patches/fused_modules.py), so a weight patch made through
either is seen by both. A host may also mark a module whose weights it has patched (current ComfyUI:
`comfy_patched_weights`, set after patching a module's weights and read at the next load to skip it; removed from
the modules in the tree when it restores them). It sets and clears that mark only on the modules in the tree at
the time, the stand-in or the original, while the weights they describe are the same tensors. A mark left on one
only made the next load skip weights that were no longer patched (the merge was lost), or patch twice weights
that still were. So each such attribute of a module with stand-ins lives in one box both refer to: a data
descriptor on the module's class reads and writes it there, and on every other instance of the class behaves as a
plain attribute does.
"""
_BOX = "_sdaccel_shared_state"
_NAMES = set()       # the attributes the host registered
_MISSING = object()


def share(names):
    """The host's attributes to share between a module and its stand-ins (ComfyUI: `comfy_patched_weights`)."""
    _NAMES.update(names)


def link(orig, standin):
    """Called when `standin` is made from `orig` (its __dict__ already copied): both refer to one box holding the
    registered attributes, moved there from `orig`; their class gets the descriptors."""
    if not _NAMES:
        return
    box = orig.__dict__.get(_BOX)
    if box is None:
        box = orig.__dict__[_BOX] = {}
    for name in _NAMES:
        _install(type(orig), name)
        value = orig.__dict__.pop(name, _MISSING)
        standin.__dict__.pop(name, None)
        if value is not _MISSING:
            box[name] = value
    standin.__dict__[_BOX] = box


def _install(cls, name):
    if not isinstance(cls.__dict__.get(name), _Shared):
        setattr(cls, name, _Shared(name))


class _Shared:
    """The attribute in the instance's box when it has one, else in its __dict__ (a plain attribute)."""

    def __init__(self, name):
        self.name = name

    def _store(self, obj):
        d = obj.__dict__
        return d.get(_BOX, d)

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        try:
            return self._store(obj)[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value):
        self._store(obj)[self.name] = value

    def __delete__(self, obj):
        try:
            del self._store(obj)[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
