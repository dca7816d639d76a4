"""A sampler's step callback delivered one step late, so that drawing a live preview never stalls the GPU.
Host-agnostic.

A host's preview callback turns each step's denoised latent into an image on the CPU. On a CUDA latent that read
waits for the GPU to finish the step, and the sampler launches the next step only after the image is drawn and
handed to the host's progress hook: the GPU idles for that time, every step. Deferred, step i's call only starts a
copy of its latent into pinned host memory on the current stream (queued behind step i's own work and ahead of
step i+1's, so it holds step i's values however the sampler reuses its buffers) and records an event; the host's
callback for step i runs at step i+1's call, on that copy, while step i+1 runs on the GPU. `flush()` delivers the
last step once the sampler has returned. Every step is delivered, in order, with its own latent, one step later.

`drop()` discards a step not yet delivered: after a failed run the host must not receive a step of it. An
exception the host's callback raises (an interrupt) leaves the sampler from the call that delivered the step, one
step later than without deferral.
"""
import time

import torch


class Snapshot:
    """A tensor on its way into host memory; `tensor()` waits for its own copy only."""

    def __init__(self, host, event=None):
        self.host, self.event = host, event

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
    """`callback(step, x0, x, total_steps)` called one step late on `snapshot(x0)` (a Snapshot, or None to call
    through at once). The deferred calls pass x as None: the callbacks deferred here read only x0."""

    def __init__(self, callback, snapshot=to_host):
        self.callback, self.snapshot = callback, snapshot
        self.pending = None          # (step, Snapshot, total_steps) not delivered yet
        self.delivered = 0           # steps delivered late
        self.host_s = 0.0            # the host's callback time over those steps, on the sampler's thread

    def __call__(self, step, x0, x, total_steps):
        snap = self.snapshot(x0)
        if snap is None:
            self.flush()
            return self.callback(step, x0, x, total_steps)
        previous, self.pending = self.pending, (step, snap, total_steps)
        if previous is not None:
            self._deliver(previous)
        return None

    def flush(self):
        """Delivers the step still held back, if any."""
        previous, self.pending = self.pending, None
        if previous is not None:
            self._deliver(previous)

    def drop(self):
        """Forgets the step still held back."""
        self.pending = None

    def _deliver(self, item):
        step, snap, total_steps = item
        t0 = time.perf_counter()
        try:
            self.callback(step, snap.tensor(), None, total_steps)
        finally:
            self.host_s += time.perf_counter() - t0
        self.delivered += 1
