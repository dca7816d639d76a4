"""A per-thread depth counter as a context: `with scope.entered(): ...`, `scope.active()` on this thread only."""
import contextlib
import threading


class ThreadScope:
    def __init__(self):
        self._tls = threading.local()

    def active(self):
        return getattr(self._tls, "depth", 0) > 0

    @contextlib.contextmanager
    def entered(self):
        self._tls.depth = getattr(self._tls, "depth", 0) + 1
        try:
            yield
        finally:
            self._tls.depth -= 1
