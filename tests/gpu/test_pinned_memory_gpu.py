"""GPU only: exactly sized page-locked host buffers (engine/pinned_memory.py) and the lowvram streamer built
on them. A buffer is pinned (full-speed copies that a CUDA graph can capture), takes whole pages of its own,
gives its registration back once its last view is gone, and the streamer's buffers replace the model's host
copies of the streamed weights instead of sitting beside them."""
import gc
import weakref

import torch

from sd_accel.engine import pinned_memory
from sd_accel.engine.offload import BlockStreamer
from sd_accel.engine.vram_plan import stream_units


def test_a_large_buffer_is_pinned_exactly_and_unregistered_when_freed():
    base = pinned_memory.registered_bytes()
    n = 5 * (1 << 20) + 3
    buf = pinned_memory.empty_pinned(n)
    assert buf.numel() == n and buf.is_pinned()
    assert buf.data_ptr() % pinned_memory.PAGE == 0
    assert pinned_memory.registered_bytes() - base == (n + 4095) // 4096 * 4096
    view = buf[100:200]
    del buf
    gc.collect()
    assert pinned_memory.registered_bytes() > base          # a view keeps the buffer and its registration
    del view
    gc.collect()
    assert pinned_memory.registered_bytes() == base


def test_copies_from_it_are_captured_in_a_graph_and_read_the_current_contents():
    host = pinned_memory.empty_pinned(4 << 20).view(torch.float16)
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
    base = pinned_memory.registered_bytes()
    names = [n for n, _ in stream_units(net)]
    s = BlockStreamer(net, names, prefetch_depth=1, device="cuda", pinned_cache={}).install()
    try:
        gc.collect()
        assert len(freed) == len(list(net.parameters()))            # the model's own host copies are gone
        assert all(b.host_flat.is_pinned() for b in s._state.values())
        exact = sum((b.nbytes + 4095) // 4096 * 4096 for b in s._state.values())
        assert pinned_memory.registered_bytes() - base == exact    # no power-of-two rounding
        with torch.no_grad():
            out = net(x)
        torch.testing.assert_close(out, ref)
    finally:
        s.remove()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in net.parameters())
