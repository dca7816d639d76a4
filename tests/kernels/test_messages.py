"""`first_line`: an exception as one line of a log message or a report, whatever its message."""
from sd_accel.kernels._messages import first_line


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


def test_the_first_line_cut_to_the_limit():
    e = ValueError("out of memory\nTried to allocate 2 GiB\n...")
    assert first_line(e) == "out of memory"
    assert first_line(RuntimeError("x" * 500)) == "x" * 200
    assert first_line(RuntimeError("x" * 500), 120) == "x" * 120


def test_an_empty_or_unreadable_message_is_an_empty_line():
    assert first_line(AssertionError()) == ""        # str(e).splitlines() is [] here
    assert first_line(RuntimeError("\nsecond")) == ""
    assert first_line(_Unprintable()) == ""


def test_anything_with_a_str_works():
    assert first_line(KeyError("weights")) == "'weights'"
    assert first_line("plain text\nmore") == "plain text"
