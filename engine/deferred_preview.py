"""A sampler's step callback delivered late, so that drawing a live preview never stalls the GPU. Host-agnostic.

A host's preview callback turns each step's denoised latent into an image on the CPU. On a CUDA latent that read
waits for the GPU to finish the step, and the sampler launches the next step only after the image is drawn and
handed to the host's progress hook: the GPU idles for that time, every step. Deferred, step i's call only starts a
copy of its latent into pinned host memory on the current stream (queued behind step i's own work and ahead of
step i+1's, so it holds step i's values however the sampler reuses its buffers) and records an event; the host's
callback for step i runs at a later step's call, on that copy, while the GPU runs the steps queued since. A step
is delivered once its copy has arrived (never at its own call), so the sampler waits for nothing while its host
runs ahead of the GPU; only when MAX_BEHIND steps are held back does it wait for the oldest, so the previews and
the progress they carry stay within a few steps of the GPU. `flush()` delivers what is held once the sampler has
returned. Every step is delivered, in order, with its own latent.

`drop()` discards the steps not yet delivered: after a failed run the host must not receive a step of it. An
exception the host's callback raises (an interrupt) leaves the sampler from the call that delivered the step, a
few steps later than without deferral.
"""
import collections
import time

import torch

MAX_BEHIND = 3   # steps held back before a call waits for the oldest one's copy


class Snapshot:
    """A tensor on its way into host memory; `tensor()` waits for its own copy only."""

    def __init__(self, host, event=None):
        self.host, self.event = host, event

    def ready(self):
        return self.event is None or self.event.query()

    def tensor(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host


def to_host(t, always=False):
    """A Snapshot of CUDA tensor `t`, copied asynchronously into pinned memory on the current stream. Any other
    tensor costs no GPU wait to read, so there is nothing to defer: None, or with `always` (tests of the
    deferral on machines without CUDA) a plain copy."""
    if not t.is_cuda:
        return Snapshot(t.detach().clone()) if always else None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return Snapshot(host, event)


class DeferredCallback:
    """`callback(step, x0, x, total_steps)` called late (see the module doc) on `snapshot(x0)` (a Snapshot, or None
    to call through at once). The deferred calls pass x as None: the callbacks deferred here read only x0."""

    def __init__(self, callback, snapshot=to_host, max_behind=MAX_BEHIND):
        self.callback, self.snapshot, self.max_behind = callback, snapshot, max_behind
        self.pending = collections.deque()   # (step, Snapshot, total_steps) not delivered yet, oldest first
        self.delivered = 0           # steps delivered late
        self.host_s = 0.0            # the host's callback time over those steps, on the sampler's thread
        self.wait_s = 0.0            # time spent waiting for a copy to arrive (a full queue, or flush)

    def __call__(self, step, x0, x, total_steps):
        snap = self.snapshot(x0)
        if snap is None:
            self.flush()
            return self.callback(step, x0, x, total_steps)
        self.pending.append((step, snap, total_steps))
        while len(self.pending) > self.max_behind or (len(self.pending) > 1 and self.pending[0][1].ready()):
            self._deliver(self.pending.popleft())
        return None

    def flush(self):
        """Delivers the steps still held back, in order."""
        while self.pending:
            self._deliver(self.pending.popleft())

    def drop(self):
        """Forgets the steps still held back."""
        self.pending.clear()

    def _deliver(self, item):
        step, snap, total_steps = item
        t0 = time.perf_counter()
        x0 = snap.tensor()
        t1 = time.perf_counter()
        try:
            self.callback(step, x0, None, total_steps)
        finally:
            self.wait_s += t1 - t0
            self.host_s += time.perf_counter() - t1
        self.delivered += 1
