"""Per-model state a host keeps on the model object itself.

An attribute of the model (a reference cycle the garbage collector frees with it), not an entry of a
WeakKeyDictionary: the state refers back to the model (its graphs, its wrappers), and a dict value that refers
to its weak key keeps every model ever accelerated alive.
"""


def state_on(obj, attr, make):
    """`obj`'s state under `attr`, made by `make()` on first use."""
    st = obj.__dict__.get(attr)
    if st is None:
        st = obj.__dict__[attr] = make()
    return st
