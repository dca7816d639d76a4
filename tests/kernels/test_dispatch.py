"""The one dispatch chain every fused op runs (kernels/_dispatch.py), on a stand-in op whose parts record
what they are called with: eligibility, launch, the NotWarmedUp / CompilingAhead fallback, the recorder."""
import threading

import pytest

from sd_accel.kernels import _dispatch
from sd_accel.kernels._compile_ahead import CompilingAhead
from sd_accel.kernels._dispatch import REFERENCE, TRITON, FusedOp, Outcome, fused_op
from sd_accel.kernels._launch import NotWarmedUp


def _toy(calls, why="", launch_raises=None):
    """An op `toy(x, scale=2, shift=0)`: its kernel computes x * scale + shift, its fallback the same + 0.5."""
    def eligible(x, scale):
        calls.append(("eligible", x, scale))
        return (not why), why

    def launch(x, scale, shift):
        calls.append(("launch", x, scale, shift))
        if launch_raises is not None:
            raise launch_raises
        return x * scale + shift

    def plan(scale):
        return "doubling" if scale == 2 else "scaling"

    def toy(x, scale=2, shift=0):
        return x, scale, shift

    op = FusedOp(toy, eligible, launch, plan)

    @op.fallback
    def reference(x, scale, shift):
        calls.append(("fallback", x, scale, shift))
        return x * scale + shift + 0.5
    return op


def test_an_eligible_call_runs_the_launch_and_records_the_kernel_with_its_plan():
    calls = []
    op = _toy(calls)
    assert op(3) == 6 and op.last_call == Outcome(TRITON, "", "doubling")
    assert calls == [("eligible", 3, 2), ("launch", 3, 2, 0)]     # each part gets the arguments it names
    assert op(3, shift=1, scale=3) == 10 and op.last_call.plan == "scaling"


def test_an_ineligible_call_records_why_and_runs_the_fallback_only():
    calls = []
    op = _toy(calls, why="odd shape")
    assert op(3, 4) == 12.5
    assert op.last_call == Outcome(REFERENCE, "odd shape") and [c[0] for c in calls] == ["eligible", "fallback"]


@pytest.mark.parametrize("exc", [NotWarmedUp("k"), CompilingAhead("k")], ids=["not-warmed-up", "compiling-ahead"])
def test_a_launch_that_cannot_run_now_falls_back_with_its_reason(exc):
    calls = []
    op = _toy(calls, launch_raises=exc)
    assert op(1) == 2.5
    assert op.last_call == Outcome(REFERENCE, type(exc).reason) and [c[0] for c in calls][-1] == "fallback"


def test_any_other_launch_error_is_raised_and_records_nothing():
    op = _toy([], launch_raises=RuntimeError("bad kernel"))
    with pytest.raises(RuntimeError):
        op(1)
    assert op.last_call is None


def test_each_thread_reads_its_own_calls_outcome():
    op = _toy([])
    op(1)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(op.last_call))
    worker.start()
    worker.join()
    assert seen == [None] and op.last_call.path == TRITON


def test_a_part_naming_an_argument_the_op_does_not_take_is_refused_at_declaration():
    def toy(x):
        return (x,)
    with pytest.raises(TypeError, match="eps"):
        FusedOp(toy, lambda x, eps: (True, ""), lambda x: x)


def test_the_op_keeps_its_public_functions_name_signature_and_doc():
    calls = []
    op = _toy(calls)
    assert op.name == "toy" and op.__name__ == "toy" and repr(op) == "<fused op toy>"


def test_declared_ops_are_registered_once_per_name(monkeypatch):
    monkeypatch.setattr(_dispatch, "_registry", {})

    def toy(x):
        """Doubles."""
        return (x,)
    op = fused_op(eligible=lambda x: (True, ""), launch=lambda x: 2 * x)(toy)
    assert _dispatch.registered_ops() == {"toy": op} and op.__doc__ == "Doubles."
    fused_op(eligible=lambda x: (True, ""), launch=lambda x: 2 * x)(toy)   # its module again (a reload)

    def other(x):
        return (x,)
    other.__name__, other.__module__ = "toy", "elsewhere"
    with pytest.raises(ValueError, match="declared in"):
        fused_op(eligible=lambda x: (True, ""), launch=lambda x: x)(other)
