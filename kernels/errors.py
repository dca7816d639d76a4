"""One line about an exception, for logs and run reports: the one helper every layer uses (kernels/ is the
lowest layer, so engine/, hosts/ and nodes/ can all import it)."""


def first_line(exc, limit=200):
    """The first line of `exc`'s message, at most `limit` characters; the type's name for an empty message
    (an `AssertionError()` has no text) or one that cannot be read (a `__str__` that raises). Never raises:
    it runs inside error handlers, where a failure of its own would hide the error being reported."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an unreadable message is reported as an empty one
        text = ""
    lines = text.splitlines()
    line = lines[0] if lines else ""
    return (line or type(exc).__name__)[:limit]
