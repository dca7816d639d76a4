"""Per-stage GPU memory report: peak allocated, reserved, fragmentation (reserved / allocated).

`MemoryReport().stage("sampling")` is a context manager; each stage records the allocator's peak inside it.
On a machine without CUDA (or for a CPU device) the values are None and `reason` says why, so the report
stays JSON-able and its one-line summary still reads.
"""
import torch

GIB = 2 ** 30
STAGES = ("text encode", "sampling", "VAE decode")   # the usual names; any name is accepted


def _cuda_device(device):
    if not torch.cuda.is_available():
        return None, "CUDA not available (CPU run)"
    if device is not None and torch.device(device).type != "cuda":
        return None, "stage ran on %s, not a CUDA device" % torch.device(device).type
    return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device()), None


class _Stage:
    def __init__(self, report, name, device):
        self.report, self.name, self.device = report, name, device

    def __enter__(self):
        self.dev, self.reason = _cuda_device(self.device)
        if self.dev is not None:
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
        return self

    def __exit__(self, exc_type, exc, tb):
        entry = {"stage": self.name, "peak_allocated": None, "peak_reserved": None, "fragmentation": None,
                 "reason": self.reason, "error": exc_type.__name__ if exc_type else None}
        if self.dev is not None:
            torch.cuda.synchronize(self.dev)
            alloc = torch.cuda.max_memory_allocated(self.dev)
            res = torch.cuda.max_memory_reserved(self.dev)
            entry.update(peak_allocated=alloc, peak_reserved=res,
                         fragmentation=round(res / alloc, 3) if alloc else None,
                         reason=None if alloc else "nothing allocated in this stage")
        self.report.record(entry)
        return False


class MemoryReport:
    """Stages in the order they ran; a stage run twice keeps its last measurement."""

    def __init__(self):
        self.stages = []

    def stage(self, name, device=None):
        return _Stage(self, name, device)

    def record(self, entry):
        self.stages = [s for s in self.stages if s["stage"] != entry["stage"]] + [dict(entry)]

    def to_dict(self):
        """JSON-able: {"stages": [{stage, peak_allocated, peak_reserved, fragmentation, reason, error}]}."""
        return {"stages": [dict(s) for s in self.stages]}

    def summary(self):
        return summary_of(self.to_dict())


def summary_of(report):
    """The one-line summary of a report dict (MemoryReport.to_dict())."""
    stages = (report or {}).get("stages") or []
    if not stages:
        return "memory: no stage recorded"
    parts = []
    for s in stages:
        if s["peak_allocated"] is None:
            parts.append("%s: n/a (%s)" % (s["stage"], s["reason"]))
        else:
            frag = "%.2fx" % s["fragmentation"] if s["fragmentation"] is not None else "n/a"
            parts.append("%s: peak %.2f GiB allocated, %.2f GiB reserved, fragmentation %s"
                         % (s["stage"], s["peak_allocated"] / GIB, s["peak_reserved"] / GIB, frag))
        if s.get("error"):
            parts[-1] += " (ended with %s)" % s["error"]
    return "memory: " + " | ".join(parts)
