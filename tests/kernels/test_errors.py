"""`first_line`: an exception as one line of a log message or a report, whatever its message."""
from sd_accel.kernels.errors import first_line


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


def test_the_first_line_cut_to_the_limit():
    e = ValueError("out of memory\nTried to allocate 2 GiB\n...")
    assert first_line(e) == "out of memory"
    assert first_line(RuntimeError("x" * 500)) == "x" * 200
    assert first_line(RuntimeError("x" * 500), 120) == "x" * 120


def test_an_empty_or_unreadable_message_gives_the_type_name():
    assert first_line(AssertionError()) == "AssertionError"    # str(e).splitlines()[0] would raise IndexError
    assert first_line(RuntimeError("\nsecond")) == "RuntimeError"
    assert first_line(_Unprintable()) == "_Unprintable"
    assert first_line(AssertionError(), 5) == "Asser"


def test_a_non_string_message_is_its_str():
    assert first_line(KeyError("weights")) == "'weights'"
    assert first_line(OSError(2, "No such file")) == "[Errno 2] No such file"
