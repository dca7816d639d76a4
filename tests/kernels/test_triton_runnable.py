"""The CUDA branches of `triton_runnable` on any machine: only `t.device` is read there, so a stand-in
with a CUDA device exercises the old-GPU refusal in CI, not just on a GPU."""
import types

import torch

from sd_accel.kernels import _device, _triton


def _on_cuda():
    return types.SimpleNamespace(device=torch.device("cuda", 0))


def test_old_gpu_is_refused_with_its_capability(monkeypatch):
    monkeypatch.setattr(_device, "capability", lambda device: (6, 1))
    ok, why = _triton.triton_runnable(_on_cuda())
    assert not ok and why == "GPU sm_61 < sm_70"


def test_capture_under_cuda_malloc_async_is_runnable_now_that_launch_handles_it(monkeypatch):
    monkeypatch.setattr(_device, "capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(_device, "async_allocator", lambda: True)
    assert _triton.triton_runnable(_on_cuda()) == (True, "")
