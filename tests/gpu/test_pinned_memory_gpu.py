"""GPU only: pinned host buffers packed into slabs (engine/memory/pinned_memory.py) and the lowvram streamer built on
them. A buffer is pinned (full-speed copies that a CUDA graph can capture), and the streamer's buffers replace
the model's host copies of the streamed weights instead of sitting beside them."""
import gc
import weakref

import torch

from sd_accel.engine.memory import pinned_memory
from sd_accel.engine.memory.offload import BlockStreamer
from sd_accel.engine.memory.stream_units import stream_units


def test_buffers_are_pinned_views_of_slabs_and_graphs_capture_copies_from_them():
    """A buffer at an offset inside its slab counts as pinned (torch checks the storage), so a CUDA graph
    captures a copy from it (run 61: registered memory did not, and the capture failed), and a replay reads
    the buffer's current contents."""
    bufs = pinned_memory.host_buffers([3 << 20, 5 << 20, 1000], pin=True)
    assert all(b.is_pinned() for b in bufs)
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1       # packed into one slab
    assert bufs[0].data_ptr() != bufs[0].untyped_storage().data_ptr()     # packed after the 5 MiB one
    host = bufs[0][:(2 << 20)].view(torch.float16)
    host.copy_(torch.arange(host.numel(), dtype=torch.float32).remainder(2048).half())
    dev = torch.empty_like(host, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dev.copy_(host, non_blocking=True)                   # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dev.copy_(host, non_blocking=True)
    host.mul_(-1)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)


class _Blocks(torch.nn.Module):
    """The streamer's view of a UNet is its stream units: here four 4 MiB Linear blocks in input_blocks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.input_blocks = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(4))

    def forward(self, x):
        for b in self.input_blocks:
            x = torch.tanh(b(x))
        return x


def test_streamed_weights_live_in_pinned_buffers_and_the_models_copies_are_freed():
    net = _Blocks()                                  # on the host: every block is streamed
    ref_net = _Blocks().cuda()
    x = torch.randn(8, 1024, device="cuda")
    ref = ref_net(x)
    freed = []
    for p in net.parameters():
        weakref.finalize(p.untyped_storage(), freed.append, 1)
    names = [n for n, _ in stream_units(net)]
    s = BlockStreamer(net, names, prefetch_depth=1, device="cuda", pinned_cache={}).install()
    try:
        gc.collect()
        assert len(freed) == len(list(net.parameters()))            # the model's own host copies are gone
        assert all(b.host_flat.is_pinned() for b in s._state.values())
        with torch.no_grad():
            out = net(x)
        torch.testing.assert_close(out, ref)
    finally:
        s.remove()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in net.parameters())
