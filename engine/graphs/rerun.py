"""A call's argument containers as they were given, so the call can run again on the same arguments.

ComfyUI's UNet consumes part of what it is given: `apply_control` pops the ControlNet and T2I adapter residuals
off the lists of the `control` dict as the blocks go. A step run a second time on the same arguments (a
compile-ahead pass, a probe's rerun from the generators' start) found those lists empty and ran without the
control: its result was off by the control's whole effect. `Containers(obj)` records every dict and list
reachable from `obj` through dicts, lists and tuples, with their items (a shallow copy each); `restore()` puts
the items back into the same objects. Each run then sees exactly what the first saw, and the last run leaves the
containers as stock's one call would. Objects other than containers are not walked: the probe's state check
(tokens.state_of) covers them, and refuses a call that changes them.
"""


class Containers:
    __slots__ = ("saved",)

    def __init__(self, obj):
        self.saved = []
        self._walk(obj, set())

    def _walk(self, obj, seen):
        if isinstance(obj, (dict, list)):
            if id(obj) in seen:
                return
            seen.add(id(obj))
            self.saved.append((obj, dict(obj) if isinstance(obj, dict) else list(obj)))
            items = obj.values() if isinstance(obj, dict) else obj
        elif isinstance(obj, tuple):
            items = obj
        else:
            return
        for v in items:
            self._walk(v, seen)

    def restore(self):
        for obj, items in self.saved:
            if isinstance(obj, dict):   # by identity, unconditionally: comparing items would compare tensors
                obj.clear()
                obj.update(items)
            else:
                obj[:] = items
