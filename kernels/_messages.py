"""One line of text for a log message or a report, from an exception of any kind."""


def first_line(exc, limit=200):
    """The first line of `exc`'s message, cut to `limit` characters; "" when the message is empty (an
    `AssertionError()`) or cannot be read (a broken `__str__`). Never raises: it runs in error handlers."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a message that cannot be read is an empty one
        return ""
    return text.splitlines()[0][:limit] if text else ""
