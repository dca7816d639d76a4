"""Freed by reference counting alone, as a dropped model must be: a reference cycle keeps its weights, and their
VRAM, until a garbage collection runs."""
import contextlib
import gc


@contextlib.contextmanager
def no_garbage_collection():
    """Inside, nothing is freed but by reference counting (a collection first clears what earlier code left)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
