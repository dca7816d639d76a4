"""A per-thread depth counter as a context: `with scope.entered(): ...`, `scope.active()` on this thread only.

`scope.local.depth` is the same test as `active()` without a call: stand-in modules read it on every forward,
where a step bound by the host pays each Python call."""
import contextlib
import threading


class _Depth(threading.local):
    depth = 0      # class default: a thread that never entered reads 0 without a lookup failing


class ThreadScope:
    def __init__(self):
        self.local = _Depth()

    def active(self):
        return self.local.depth > 0

    @contextlib.contextmanager
    def entered(self):
        self.local.depth += 1
        try:
            yield
        finally:
            self.local.depth -= 1
