"""Which fused kernels actually ran and which fell back, and why.

Each fused op keeps its latest call's outcome (`op.last_call`: the path, "triton" or "reference", and
why the reference ran); the fused modules record it here right after the call, under their own name.
Inside a CUDA graph the Python side runs only at capture: the graph runner keeps the calls its capture
recorded and adds them again on every replay (`replayed`), so the counts are the kernels the GPU actually
ran, eager or replayed.
A fallback reason is logged once per (op, reason), not once per call.
"""
import logging
import threading
from collections import Counter

from ...kernels import _compile_ahead

log = logging.getLogger("sd_accel")
_lock = threading.Lock()
_counts = Counter()          # (op, path) -> calls
_reasons = {}                # op -> set of reasons it fell back for
_logged = set()


def record(op, outcome):
    """Count one call of `op` by its `outcome` (a kernels._dispatch.Outcome; None: unknown)."""
    path = outcome.path if outcome is not None else "unknown"
    with _lock:
        _counts[(op, path)] += 1
        if path == "reference":
            reason = outcome.reason or "not eligible"
            _reasons.setdefault(op, set()).add(reason)
            if (op, reason) not in _logged and not _compile_ahead.compiling_ahead():
                _logged.add((op, reason))
                log.info("[SD Accel] %s: using the stock path (%s)", op, reason)


def replayed(counts):
    """A CUDA graph replay ran again the calls its capture recorded (`counts`: a snapshot difference)."""
    with _lock:
        _counts.update(counts)


def calls_between(before, after):
    """The (op, path) call counts recorded between two snapshots, for `replayed`."""
    return after[0] - before[0]


def rollback(snap):
    """Forget every call recorded since `snap` (a call whose result was discarded: compiling ahead)."""
    counts, reasons = snap
    with _lock:
        _counts.clear()
        _counts.update(counts)
        _reasons.clear()
        _reasons.update({k: set(v) for k, v in reasons.items()})


def snapshot():
    with _lock:
        return Counter(_counts), {k: set(v) for k, v in _reasons.items()}


def summarize(before, after):
    """{op: {"fused": n, "fallback": n, "reasons": [...]}} for the calls between two snapshots."""
    c0, _ = before
    c1, reasons = after
    out = {}
    for (op, path), n in c1.items():
        d = n - c0.get((op, path), 0)
        if d <= 0:
            continue
        e = out.setdefault(op, {"fused": 0, "fallback": 0, "reasons": []})
        ok = path not in ("reference", "unknown")   # "triton", or the attention backend that ran
        e["fused" if ok else "fallback"] += d
        if not ok:
            e["reasons"] = sorted(reasons.get(op, ()))
    return out
