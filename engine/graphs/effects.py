"""Module state a step's patch functions store, set again after each replay of the step's graph.

A patch may store into its module on every call: Forge's Kohya HRFix patch sets `shared.kohya_shrink_shape` (the
shape it left the features in), and Forge's SAG reads it after the step to fold its attention map back. A replay
runs no Python, so without this the value would stay what the last eager call stored, another step's (the other
side of the schedule's downscale): SAG's reshape then fails, or folds the map at the wrong size.

What the capture run stored is what every replay of that graph stores: the graph is keyed on everything the
patch's Python decides on (keys.py, tokens.py), and a tensor stored is the capture's own, which each replay
rewrites. A patch that reads what it stores (a counter) has the value in its key (tokens.global_reads), so each
value is a new key and the churn rule refuses it. The targets come from the probe (tokens.write_targets).
"""
_MISSING = object()


def record(targets):
    """(target, value) for each target as it is now (after the capture run); a target not set is recorded missing."""
    return tuple((t, _get(t)) for t in targets)


def apply(effects):
    for target, value in effects:
        kind, held, name = target
        if kind == "global":
            if value is _MISSING:
                held.obj.pop(name, None)
            else:
                held.obj[name] = value
        elif value is _MISSING:
            if name in vars(held.obj):
                delattr(held.obj, name)
        else:
            setattr(held.obj, name, value)


def _get(target):
    kind, held, name = target
    if kind == "global":
        return held.obj.get(name, _MISSING)
    return vars(held.obj).get(name, _MISSING)
