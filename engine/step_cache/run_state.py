"""One sampling run's step-cache state: made when the run starts, dropped when it ends, never shared.

The step a call belongs to is the number of sampler steps the run has finished (the host reports each end,
e.g. ComfyUI's per-step callback), so it does not depend on how many model calls a step makes: Heun's second
call, which the sampler makes after reporting its step, belongs to the next step, as its sigma does. A call's
slot is what the host says makes two calls interchangeable (ComfyUI: the batch's shape, dtype and which conds
it holds); each slot keeps its own feature. A call runs cached only where its step is not a full step of the
schedule, its slot has a feature from this run, and the run has not gone past its scheduled steps.
"""
from collections import Counter

from . import schedule


class StepCacheRun:
    def __init__(self, mode, total_steps, branch):
        self.mode, self.total, self.branch = mode, int(total_steps), int(branch)
        self.full = frozenset(schedule.full_steps(self.total, mode))
        self.step = 0
        self.features = {}                 # slot -> the deep feature of its last full call
        self.calls = Counter()             # "full" / "cached" -> calls
        self.cached_steps, self.full_run = set(), set()
        self.refused = Counter()           # one-line reason -> calls that ran the whole UNet for it

    def step_done(self):
        self.step += 1

    def cached_feature(self, slot):
        """The feature a call of `slot` runs on now, or None: the call runs the whole UNet."""
        if self.step in self.full or self.step >= self.total:
            return None
        return self.features.get(slot)

    def ran_full(self, slot, feature):
        """A full call of `slot` finished; `feature` (None if the UNet never reached the branch) is kept."""
        self.calls["full"] += 1
        self.full_run.add(self.step)
        if feature is None:
            self.features.pop(slot, None)
        else:
            self.features[slot] = feature

    def ran_cached(self):
        self.calls["cached"] += 1
        self.cached_steps.add(self.step)

    def refuse(self, why):
        self.refused[why] += 1

    def summary(self):
        """What the run did, JSON-able: steps (reported by the sampler), steps that ran cached only, calls."""
        cached_only = self.cached_steps - self.full_run
        return {"mode": self.mode, "branch": self.branch, "steps": self.total, "steps_reported": self.step,
                "cached_steps": len(cached_only), "full_calls": self.calls["full"],
                "cached_calls": self.calls["cached"], "refused": dict(self.refused)}

    def release(self):
        self.features.clear()
