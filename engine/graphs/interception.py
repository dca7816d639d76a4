"""Torch methods swapped for watching wrappers while a watch is active on some thread.

A watch (host_reads.HostReads, waits.Waits) is a context: while one is entered on a thread, calls of the
intercepted methods on that thread go to the watch; other threads, and calls made while no watch is active,
go straight to torch. The swap is counted across threads and undone when the last watch exits, putting back
exactly what was there (an attribute a class only inherited is deleted again rather than pinned).
"""
import threading


class Interception:
    def __init__(self, targets, make_wrapper):
        """`targets()`: [(owner, name)] to intercept; `make_wrapper(self, owner, name, original)`: the replacement."""
        self.targets, self.make_wrapper = targets, make_wrapper
        self.tls = threading.local()
        self.lock = threading.Lock()
        self.depth = 0
        self.saved = []          # (owner, name, original, owned by the owner itself)

    def current(self):
        return getattr(self.tls, "watch", None)

    def enter(self, watch):
        with self.lock:
            if self.depth == 0:
                for owner, name in self.targets():
                    original = getattr(owner, name)
                    self.saved.append((owner, name, original, name in vars(owner)))
                    setattr(owner, name, self.make_wrapper(self, owner, name, original))
            self.depth += 1
        outer, self.tls.watch = self.current(), watch
        return outer

    def exit(self, outer):
        self.tls.watch = outer
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                for owner, name, original, owned in reversed(self.saved):
                    if owned:
                        setattr(owner, name, original)
                    else:
                        delattr(owner, name)
                self.saved.clear()


class Watch:
    """A context that is the current watch of its Interception (`interception`, set by subclasses)."""
    interception = None

    def __enter__(self):
        self._outer = self.interception.enter(self)
        return self

    def __exit__(self, *exc):
        self.interception.exit(self._outer)
