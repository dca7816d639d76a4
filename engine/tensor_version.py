"""A tensor's in-place version counter, where torch keeps one."""


def version_of(t):
    """`t._version`, or None where torch keeps no version counter: an inference tensor (ComfyUI loads weights under
    inference_mode), and a tensor outside inference mode whose data is one (a module made under inference_mode and
    moved by `.to()` outside it: its `is_inference()` is False, yet reading the counter raises). For those, an
    in-place update is caught by the host's own word for its weight patches."""
    if t.is_inference():
        return None
    try:
        return t._version
    except RuntimeError:
        return None
