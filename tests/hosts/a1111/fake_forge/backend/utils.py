"""Stand-in for the attribute helpers of Forge's `backend.utils`: dotted paths from a root module."""


def get_attr(obj, path):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def set_attr_raw(obj, path, value):
    parent, _, last = path.rpartition(".")
    setattr(get_attr(obj, parent) if parent else obj, last, value)
