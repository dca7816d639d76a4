"""The one dispatch chain of every fused op, and the record of which path each call took.

An op file declares its op once, on its public function:

    @fused_op(eligible=eligible, launch=_launch)
    def geglu(h):
        '''...'''
        return (h,)

    @geglu.fallback
    def _reference_contiguous(h): ...

The decorated function binds the call (Python fills in the defaults) and returns the arguments, prepared;
`eligible`, the launcher, the fallback and the optional `plan` each take the ones they name (matched by
parameter name once, when the op is declared). Every call then runs one chain:

1. `eligible(...)` -> (ok, why);
2. if ok, the launcher; its output is the op's, recorded as "triton" (with `plan(...)`, the Triton path
   taken, for an op that has more than one);
3. a launch that raised NotWarmedUp (a CUDA-graph capture found no compiled kernel; CompilingAhead, its
   kernel is being compiled ahead) gives its reason instead;
4. otherwise recorded as "reference" with the reason, then the fallback: the plain-torch reference, with
   the output in the layout the kernel's would have.

The fallback is attached after the op (`@op.fallback`, on the reference itself where no output needs
adjusting), so the reference can follow the op in its file: kernel, launcher, op, reference. An op's
latest outcome is kept per thread in `recorder`: `op.last_call`, read by the caller right after the call
(engine/kernel_report.py files it under the caller's own name).
"""
import functools
import inspect
import threading
from typing import NamedTuple, Optional

from ._launch import NotWarmedUp

TRITON = "triton"
REFERENCE = "reference"


class Outcome(NamedTuple):
    """What one call of an op did."""
    path: str                   # TRITON, REFERENCE (or, for engine/attention.py, the backend that ran)
    reason: str = ""            # why the reference ran
    plan: Optional[str] = None  # which Triton path ran, for an op with more than one


class _Latest(threading.local):
    def __init__(self):
        self.by_op = {}


class Recorder:
    """The latest Outcome of each op, per thread (two threads calling one op each read their own call's)."""

    def __init__(self):
        self._latest = _Latest()

    def note(self, op, outcome):
        self._latest.by_op[op] = outcome

    def latest(self, op):
        """The Outcome of `op`'s latest call on this thread, None before its first."""
        return self._latest.by_op.get(op)


recorder = Recorder()
_registry = {}   # op name -> FusedOp


def registered_ops():
    """{name: FusedOp} of every op declared so far (an op is declared when its module is imported)."""
    return dict(_registry)


def _positions(part, names, role):
    """Where each parameter of `part` sits in the op's argument tuple (`names`)."""
    params = list(inspect.signature(part).parameters)
    missing = [p for p in params if p not in names]
    if missing:
        raise TypeError(f"{role} {part.__name__} takes {missing}, which the op does not")
    return tuple(names.index(p) for p in params)


def _pick(call, positions):
    return [call[i] for i in positions]


class FusedOp:
    """A fused op: `op(...)` runs the chain in the module's docstring; `op.last_call` is its latest Outcome."""

    def __init__(self, bind, eligible, launch, plan=None):
        functools.update_wrapper(self, bind)
        self.name = bind.__name__
        self._bind = bind
        self._names = list(inspect.signature(bind).parameters)
        self.eligible, self.launch, self.plan = eligible, launch, plan
        self._eligible_at = _positions(eligible, self._names, "eligible")
        self._launch_at = _positions(launch, self._names, "launch")
        self._plan_at = _positions(plan, self._names, "plan") if plan is not None else ()
        self._fallback = None
        self._fallback_at = ()

    def fallback(self, fn):
        """Decorator: `fn` (taking the op's arguments it names) runs when the kernel cannot. Returns fn."""
        self._fallback, self._fallback_at = fn, _positions(fn, self._names, "fallback")
        return fn

    @property
    def last_call(self):
        return recorder.latest(self)

    def __call__(self, *args, **kwargs):
        call = self._bind(*args, **kwargs)
        ok, why = self.eligible(*_pick(call, self._eligible_at))
        if ok:
            try:
                out = self.launch(*_pick(call, self._launch_at))
            except NotWarmedUp as e:
                why = e.reason
            else:
                plan = self.plan(*_pick(call, self._plan_at)) if self.plan is not None else None
                recorder.note(self, Outcome(TRITON, "", plan))
                return out
        recorder.note(self, Outcome(REFERENCE, why))
        return self._fallback(*_pick(call, self._fallback_at))

    def __repr__(self):
        return f"<fused op {self.name}>"


def fused_op(*, eligible, launch, plan=None):
    """Declare the decorated function a fused op (see the module's docstring); its name is the op's."""
    def declare(bind):
        op = FusedOp(bind, eligible, launch, plan)
        earlier = _registry.get(op.name)
        if earlier is not None and earlier.__module__ != op.__module__:   # (its own module reloaded replaces it)
            raise ValueError(f"fused op {op.name!r} declared in {earlier.__module__} and {op.__module__}")
        _registry[op.name] = op
        return op
    return declare
