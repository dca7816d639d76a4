"""engine/deferred_preview.py: a step callback delivered late (once its copy has arrived, never at its own call, at
most MAX_BEHIND steps held), in order, each step with its own latent; the rest on flush; nothing after drop; an
exception from the host's callback leaves the sampler; CPU latents call through at once."""
import pytest
import torch

from sd_accel.engine import deferred_preview as dp


def _cpu_snapshot(x0):
    """Stands in for the pinned copy on CPU: a copy taken at the call, so later writes to x0 cannot reach it."""
    return dp.Snapshot(x0.clone())


class Recorder:
    def __init__(self, fail_at=None):
        self.calls, self.fail_at = [], fail_at

    def __call__(self, step, x0, x, total):
        if step == self.fail_at:
            raise KeyboardInterrupt("interrupted at %d" % step)
        self.calls.append((step, x0.flatten()[0].item(), x, total))


def _sample(callback, steps, buffer):
    """A sampler loop that reuses one latent buffer, as a graph replay does: step i writes i into it."""
    for i in range(steps):
        buffer.fill_(float(i))
        callback(i, buffer, "x", steps)


def test_each_step_is_delivered_one_step_late_with_its_own_latent():
    rec = Recorder()
    deferred = dp.DeferredCallback(rec, _cpu_snapshot)
    buf = torch.zeros(2, 4, 8, 8)
    delivered_during = []
    for i in range(4):
        buf.fill_(float(i))
        deferred(i, buf, "x", 4)
        delivered_during.append([c[0] for c in rec.calls])
    assert delivered_during == [[], [0], [0, 1], [0, 1, 2]]
    deferred.flush()
    assert rec.calls == [(i, float(i), None, 4) for i in range(4)]
    deferred.flush()
    assert len(rec.calls) == 4 and deferred.delivered == 4, "a second flush delivers nothing more"


def test_drop_forgets_the_held_step():
    rec = Recorder()
    deferred = dp.DeferredCallback(rec, _cpu_snapshot)
    _sample(deferred, 3, torch.zeros(1, 4, 4, 4))
    deferred.drop()
    deferred.flush()
    assert [c[0] for c in rec.calls] == [0, 1]


def test_an_exception_of_the_host_callback_leaves_the_sampler_and_later_steps_are_not_delivered():
    rec = Recorder(fail_at=1)
    deferred = dp.DeferredCallback(rec, _cpu_snapshot)
    with pytest.raises(KeyboardInterrupt, match="interrupted at 1"):
        _sample(deferred, 5, torch.zeros(1, 4, 4, 4))
    assert [c[0] for c in rec.calls] == [0]
    assert [p[0] for p in deferred.pending] == [2], "the step held back when the interrupt came"
    deferred.drop()
    deferred.flush()
    assert [c[0] for c in rec.calls] == [0]


def test_cpu_latents_call_through_at_once_with_x():
    rec = Recorder()
    deferred = dp.DeferredCallback(rec)   # the real to_host: nothing to defer for a CPU tensor
    buf = torch.zeros(1, 4, 4, 4)
    buf.fill_(3.0)
    deferred(0, buf, "x", 2)
    assert rec.calls == [(0, 3.0, "x", 2)]
    assert dp.to_host(buf) is None
    copy = dp.to_host(buf, always=True).tensor()
    buf.fill_(4.0)
    assert copy.flatten()[0].item() == 3.0, "always: a copy, not a view"


def test_a_step_that_cannot_be_deferred_first_delivers_the_held_one():
    """Order is kept when deferral stops mid-run (a snapshot function answering None)."""
    rec = Recorder()
    answers = iter([_cpu_snapshot, lambda x0: None])
    deferred = dp.DeferredCallback(rec, lambda x0: next(answers)(x0))
    buf = torch.zeros(1, 4, 4, 4)
    _sample(deferred, 2, buf)
    assert [(c[0], c[2]) for c in rec.calls] == [(0, None), (1, "x")]


class _Copy(dp.Snapshot):
    """A copy whose arrival the test decides (a CUDA event's query, on a CPU)."""
    arrived = set()

    def __init__(self, x0, step):
        super().__init__(x0.clone())
        self.step = step

    def ready(self):
        return self.step in self.arrived


def test_a_step_whose_copy_has_not_arrived_is_held_without_a_wait_until_max_behind_are_held():
    rec = Recorder()
    steps = iter(range(100))
    deferred = dp.DeferredCallback(rec, lambda x0: _Copy(x0, next(steps)), max_behind=3)
    buf = torch.zeros(1, 4, 4, 4)
    _Copy.arrived = set()
    for i in range(3):                     # the host runs ahead: no copy has arrived yet
        buf.fill_(float(i))
        deferred(i, buf, "x", 6)
    assert rec.calls == [] and [p[0] for p in deferred.pending] == [0, 1, 2]
    buf.fill_(3.0)
    deferred(3, buf, "x", 6)               # a fourth held step: the oldest is delivered (its copy waited for)
    assert [c[0] for c in rec.calls] == [0]
    _Copy.arrived = {1, 2, 3, 4}
    buf.fill_(4.0)
    deferred(4, buf, "x", 6)               # every arrived copy but the newest step's own
    assert [c[0] for c in rec.calls] == [0, 1, 2, 3]
    deferred.flush()
    assert rec.calls == [(i, float(i), None, 6) for i in range(5)]
