"""What a failed capture leaves behind (engine/graphs/capture.keep_failed_capture): the allocations are kept for
the process's life, but not the traceback's frames, which hold the step's closure and with it the model: a host
that drops the model must get its memory back. Runs on any device (the kept tensors are checked on the GPU, in
tests/gpu/test_failed_capture_gpu.py)."""
import gc
import weakref

import torch

from sd_accel.engine.graphs import capture


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 8)

    def step(self, x):
        h = self.net(x)   # noqa: F841 - a local of the failing frame, as a capture's allocation is
        raise RuntimeError("operation not permitted when stream is capturing")


def _fail(model):
    try:
        model.step(torch.randn(2, 8))
    except RuntimeError as e:
        capture.keep_failed_capture(e, "graph", "pool")
        return e


def test_a_failed_capture_keeps_its_items_but_not_the_model_its_frames_held():
    model = _Model()
    gone = weakref.ref(model)
    before = len(capture._KEPT)
    e = _fail(model)
    assert len(capture._KEPT) == before + 1 and capture._KEPT[-1][1:] == ("graph", "pool")
    assert e.__traceback__ is None and "capturing" in str(e)   # the message stays for the report
    del model
    gc.collect()
    assert gone() is None


def test_only_gpu_tensors_that_are_not_weights_are_kept():
    if not torch.cuda.is_available():
        cpu = torch.ones(3)
        assert capture._tensors_in({"a": [cpu, torch.nn.Parameter(cpu)]}) == []
        return
    t = torch.ones(3, device="cuda")
    w = torch.nn.Parameter(torch.ones(3, device="cuda"))
    found = capture._tensors_in({"a": [t, w], "b": (t,)})
    assert len(found) == 2 and all(f is t for f in found)
