"""ComfyUI's live previews during an accelerated run, each drawn from a finished copy of its step's latent while
the next step runs on the GPU (engine/deferred_preview.py): no wait per step (ComfyUI 2024 reads the latent with
`.cpu()`), and never a copy still on its way (the current ComfyUI draws from its non_blocking copy at once).

ComfyUI's `common_ksampler` builds its step callback itself: `latent_preview.prepare_callback` takes a previewer
from `latent_preview.get_previewer` and a ProgressBar, whose hook sends the `progress` message and the preview
image. There is no way to hand it another callback (ComfyUI 2024 has no sampler wrappers), so inside
`DeferredPreviews` those two functions of `latent_preview` are watched on this thread only (an Interception, as
torch's methods are during graph capture: other threads, and calls outside the context, reach ComfyUI's own).

prepare_callback then returns ComfyUI's own callback, delivered a few steps late, when all of this holds:
  - it is ComfyUI's own prepare_callback (no other pack replaced it) and has no x0_output_dict to fill;
  - its previewer is ComfyUI's Latent2RGBPreviewer, which draws the same image from a host copy of the latent
    (ComfyUI 2024's multiplies on the CPU in any case); the copy holds the first image only, the one it draws;
  - the latent is on a CUDA device (elsewhere reading it costs no wait: the callback runs as it is).
Anything else (previews off, TAESD, whose decoder runs on the GPU) keeps ComfyUI's callback unchanged. Leaving
the context delivers the steps held back; after an exception they are dropped.
"""
import threading

from ...engine import deferred_preview
from ...engine.graphs.interception import Interception, Watch

_lock = threading.Lock()
_interception = None


def _latent_preview():
    import latent_preview
    return latent_preview


def _watched(interception, owner, name, original):
    def call(*args, **kwargs):
        watch = interception.current()
        if watch is None:
            return original(*args, **kwargs)
        return getattr(watch, name)(original, *args, **kwargs)
    return call


def _shared_interception():
    global _interception
    with _lock:
        if _interception is None:
            lp = _latent_preview()
            # only what this ComfyUI has: without get_previewer no previewer is seen, and nothing is deferred
            _interception = Interception(lambda: [(lp, name) for name in ("prepare_callback", "get_previewer")
                                                  if hasattr(lp, name)], _watched)
    return _interception


def first_image_to_host(x0):
    return deferred_preview.to_host(x0[:1])


def first_image_copy(x0):
    """Deferred on any device (SDACCEL_DEFERRED_PREVIEWS=always: tests through a real server without CUDA)."""
    return deferred_preview.to_host(x0[:1], always=True)


class DeferredPreviews(Watch):
    """Context around one sampling call; `snapshot` as in DeferredCallback (tests pass a CPU one)."""

    def __init__(self, snapshot=first_image_to_host):
        self.interception = _shared_interception()
        self.snapshot = snapshot
        self.previewers = []
        self.deferred = []

    def get_previewer(self, original, *args, **kwargs):
        previewer = original(*args, **kwargs)
        self.previewers.append(previewer)
        return previewer

    def prepare_callback(self, original, *args, **kwargs):
        if getattr(original, "__module__", None) != "latent_preview":   # another pack's: its own arguments
            return original(*args, **kwargs)
        return self._prepare(original, *args, **kwargs)

    def _prepare(self, original, model, steps, x0_output_dict=None):
        seen = len(self.previewers)
        callback = original(model, steps, x0_output_dict)
        made = self.previewers[seen:]
        if x0_output_dict is not None or len(made) != 1 or type(made[0]) is not _latent_preview().Latent2RGBPreviewer:
            return callback
        deferred = deferred_preview.DeferredCallback(callback, self.snapshot)
        self.deferred.append(deferred)
        return deferred

    def note(self):
        """The run report's line, or None where nothing was deferred."""
        late = sum(d.delivered for d in self.deferred)
        if not late:
            return None
        host_ms = 1000.0 * sum(d.host_s for d in self.deferred) / late
        wait_ms = 1000.0 * sum(d.wait_s for d in self.deferred) / late
        return ("live previews: %d delivered a few steps late, without a GPU wait per step (%.2f ms each on the "
                "sampler's thread to draw and hand to ComfyUI, %.2f ms waiting for the copy)"
                % (late, host_ms, wait_ms))

    def __exit__(self, exc_type, exc, tb):
        try:
            for deferred in self.deferred:
                if exc_type is None:
                    deferred.flush()
                else:
                    deferred.drop()
        finally:
            super().__exit__(exc_type, exc, tb)
