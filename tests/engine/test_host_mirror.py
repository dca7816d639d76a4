"""engine/memory/host_mirror.py on the CPU. Weights "on the GPU" are stood in by host tensors filled with NaN that
the mirror is told are off the host (`on_host`): a move back that reuses the mirror's copy must not read
them (every value must come out as the copy's, bit for bit), a move that has no valid copy must copy them.
Through ComfyUI's real unloads on a GPU: tests/gpu/test_host_mirror_gpu.py."""
import gc
import weakref

import pytest
import torch
from torch import nn

from sd_accel.engine.memory import host_mirror


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(4, 8, 3), nn.GroupNorm(2, 8), nn.Linear(8, 8))
    m.register_buffer("table", torch.arange(5.0))
    return m


class Device:
    """Which tensors stand for GPU ones: those whose storage was handed out by `load`."""

    def __init__(self):
        self.ptrs = set()
        self.keep = []      # the stand-ins stay allocated, so no later host tensor gets one of their addresses

    def mark(self, t):
        self.keep.append(t)
        self.ptrs.add(t.data_ptr())

    def on_host(self, t):
        return t.data_ptr() not in self.ptrs

    def load(self, m, fill=float("nan")):
        """A host's .to(cuda), in the test's terms: each parameter gets new data off the host."""
        for p in m.parameters():
            p.data = torch.full_like(p, fill) if fill is not None else p.data.clone()
            self.mark(p.data)


def test_first_move_copies_then_later_moves_reuse_without_reading_the_device():
    m, dev = _model(), Device()
    values = {n: p.detach().clone() for n, p in m.named_parameters()}
    mirror = host_mirror.HostMirror(pin=False)
    dev.load(m, fill=None)                      # on the "GPU": the same values
    copied = mirror.offload(m, dev.on_host)
    assert copied == sum(p.numel() * 4 for p in m.parameters())
    assert mirror.stats["copied"] == 6 and mirror.stats["reused"] == 0
    for n, p in m.named_parameters():
        assert dev.on_host(p) and torch.equal(p, values[n])
    hosts = {n: p.data for n, p in m.named_parameters()}
    dev.load(m)                                  # back on the "GPU" (NaN: must not be read)
    assert mirror.offload(m, dev.on_host) == 0
    assert mirror.stats["reused"] == 6
    for n, p in m.named_parameters():
        assert p.data is hosts[n] or p.data_ptr() == hosts[n].data_ptr()
        assert torch.equal(p, values[n]), n


def test_a_replaced_parameter_is_copied_afresh_not_taken_from_the_old_copy():
    m, dev = _model(), Device()
    mirror = host_mirror.HostMirror(pin=False)
    dev.load(m, fill=None)
    mirror.offload(m, dev.on_host)
    lin = m[2]
    lin.weight = nn.Parameter(torch.full_like(lin.weight, 3.0), requires_grad=False)   # ComfyUI's LoRA patch
    dev.load(m, fill=None)
    mirror.offload(m, dev.on_host)
    assert torch.equal(lin.weight, torch.full_like(lin.weight, 3.0))
    assert mirror.stats["copied"] == 7 and mirror.stats["reused"] == 5


def test_a_copy_whose_shape_or_dtype_no_longer_fits_is_not_used():
    m, dev = _model(), Device()
    mirror = host_mirror.HostMirror(pin=False)
    dev.load(m, fill=None)
    mirror.offload(m, dev.on_host)
    m[0].weight.data = torch.ones(8, 4, 1, 1, dtype=torch.float16)   # the module was rebuilt in place
    dev.mark(m[0].weight.data)
    mirror.offload(m, dev.on_host)
    assert m[0].weight.shape == (8, 4, 1, 1) and m[0].weight.dtype == torch.float16
    assert torch.equal(m[0].weight, torch.ones(8, 4, 1, 1, dtype=torch.float16))


def test_copies_keep_the_layout_and_dead_parameters_are_forgotten():
    m, dev = _model(), Device()
    m[0].weight.data = m[0].weight.data.to(memory_format=torch.channels_last)
    mirror = host_mirror.HostMirror(pin=False)
    for p in m.parameters():
        dev.mark(p.data)
    mirror.offload(m, dev.on_host)
    assert m[0].weight.is_contiguous(memory_format=torch.channels_last)
    lin = m[2]
    lin.weight = nn.Parameter(lin.weight.detach().clone())
    gc.collect()
    mirror.offload(m, dev.on_host)
    assert len(mirror.copies) == 5               # the old Linear weight's copy dropped, the new one not copied


def test_module_to_host_goes_through_the_mirror_and_other_moves_do_not(monkeypatch):
    m = _model()
    mirror = host_mirror.arm(m, pin=False)
    seen = []
    monkeypatch.setattr(mirror, "offload", lambda mod, on_host=None: seen.append(mod) or 0)
    try:
        assert m.to("cpu") is m
        m.to(device=torch.device("cpu"))
        m.to(torch.device("cpu"), torch.float32)
        m.to(torch.float64)                          # a dtype move: ordinary path
        m[0].to("cpu")                               # a submodule's own .to: ordinary path
        assert seen == [m, m, m]
        assert m[0].weight.dtype == torch.float64
    finally:
        host_mirror.disarm(m)


def test_arm_is_idempotent_and_disarm_restores_the_class_method():
    m = _model()
    a = host_mirror.arm(m)
    assert host_mirror.arm(m) is a and host_mirror.mirror_of(m) is a
    assert "to" in m.__dict__
    host_mirror.disarm(m)
    assert "to" not in m.__dict__ and host_mirror.mirror_of(m) is None
    host_mirror.disarm(m)
    assert m.to("cpu") is m


def test_an_armed_module_can_still_be_freed():
    m = _model()
    host_mirror.arm(m, pin=False)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_release_freed_notices_a_freed_mirrored_module():
    m = _model()
    host_mirror.arm(m, pin=False)
    host_mirror.release_freed()
    assert host_mirror.release_freed() is False        # nothing freed since
    del m
    gc.collect()
    assert host_mirror.release_freed() is True
    assert host_mirror.release_freed() is False



def test_a_streamers_buffer_takes_over_the_mirrors_copies_and_their_slabs_are_freed(monkeypatch):
    """After a full load and unload the mirror holds a copy of every UNet weight; under lowvram the streamed
    blocks' weights are then copied into the streamer's buffers (device run 62: SDXL at 2 GiB held 7.75 GiB
    for a 4.78 GiB UNet). The streamer's views take over the mirror's records, and the mirror's slabs, packed
    per numbered block, are freed; a later move off the "GPU" reuses the views. (pin=True packs into slabs;
    on this machine they are pageable.)"""
    import comfy_inproc
    from sd_accel.engine.memory import pinned_memory
    from sd_accel.engine.memory.offload import BlockStreamer
    from sd_accel.engine.memory.stream_units import stream_units
    monkeypatch.setattr(pinned_memory, "_warned", ["(this test)"])          # no warning about pinning
    unet, dev = comfy_inproc.tiny_unet(seed=8), Device()
    values = {n: p.detach().clone() for n, p in unet.named_parameters()}
    mirror = host_mirror.arm(unet, pin=False)
    mirror.pin = True                                   # asks for pinned slabs, as on a GPU machine
    try:
        dev.load(unet, fill=None)
        mirror.offload(unet, dev.on_host)               # every parameter now at the mirror's copy
        slabs = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in unet.parameters()}
        assert len(slabs) < len(values)                  # packed
        freed = []
        for st in slabs.values():
            weakref.finalize(st, freed.append, 1)
        del st
        slabs = len(slabs)
        s = BlockStreamer(unet, [n for n, _ in stream_units(unet)], device="cpu").install()
        gc.collect()
        assert len(freed) == slabs                      # every slab of the mirror's is gone, not held beside
        flats = [b.host_flat for b in s._state.values()]
        s.remove()
        in_flats = lambda t: any(f.data_ptr() <= t.data_ptr() < f.data_ptr() + f.numel()  # noqa: E731
                                 for f in flats)
        assert all(in_flats(h) for _, h in mirror.copies.values())
        dev.load(unet)                                   # back on the "GPU" (NaN), then off again
        assert mirror.offload(unet, dev.on_host) == 0
        for n, p in unet.named_parameters():
            assert in_flats(p) and torch.equal(p, values[n]), n
    finally:
        host_mirror.disarm(unet)
