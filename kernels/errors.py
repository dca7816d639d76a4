"""One line about an exception, for logs and run reports."""


def first_line(exc, limit=200):
    """The first line of `exc`'s message, at most `limit` characters; the type's name for an empty message
    (an `AssertionError()` has no text, and a report line must never fail on it)."""
    text = str(exc)
    lines = text.splitlines()
    line = lines[0] if lines else ""
    return (line or type(exc).__name__)[:limit]
