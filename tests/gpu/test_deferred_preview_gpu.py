"""engine/deferred_preview.py on a CUDA device: the pinned copy holds the latent as it was at the call, and a
deferred step's call returns while the GPU is still busy (no synchronisation), delivering only the steps whose copy
has arrived."""
import torch

from sd_accel.engine import deferred_preview as dp


def test_to_host_copies_a_cuda_tensor_as_it_was_when_called():
    t = torch.arange(16, dtype=torch.float32, device="cuda").reshape(1, 16)
    snap = dp.to_host(t)
    t.fill_(-1.0)                      # queued after the copy on the same stream
    host = snap.tensor()
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, torch.arange(16, dtype=torch.float32).reshape(1, 16))


def test_a_deferred_call_does_not_wait_for_the_gpu():
    got = []
    deferred = dp.DeferredCallback(lambda step, x0, x, total: got.append((step, x0.flatten()[0].item())))
    buf = torch.zeros(1, 4, 64, 64, device="cuda")
    stream = torch.cuda.current_stream()
    for i in range(3):
        buf.fill_(float(i))
        torch.cuda._sleep(200_000_000)     # a step's work still running on the GPU when the callback comes
        deferred(i, buf, None, 3)
        assert not stream.query(), "step %d's callback waited for the GPU" % i
    assert got == [], "no step's copy had arrived: none is delivered, none waited for"
    torch.cuda.synchronize()
    buf.fill_(3.0)
    deferred(3, buf, None, 4)              # the three copies have arrived: delivered, the new step held
    assert got == [(0, 0.0), (1, 1.0), (2, 2.0)]
    deferred.flush()
    assert got == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
