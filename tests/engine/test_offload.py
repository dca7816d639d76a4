"""engine/memory/offload.py (BlockStreamer) on ComfyUI's real openaimodel UNetModel, on CPU: the same output as
without streaming, install/remove leaves the module exactly as it was (Parameter objects, names, data,
hooks), the prefetch order and the ring are the planner's (vram_plan, ring), and places shared by several blocks never hand a
block another's weights."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402

from sd_accel.engine.memory import residency  # noqa: E402
from sd_accel.engine.memory.offload import BlockStreamer  # noqa: E402
from sd_accel.engine.memory.ring import ring_layout  # noqa: E402
from sd_accel.engine.memory.stream_units import (off_device_bytes, owned_tensors, stream_units,  # noqa: E402
                                                 unet_block_sizes)
from sd_accel.engine.memory.vram_plan import min_budget, plan_residency  # noqa: E402


@pytest.fixture(scope="module")
def unet():
    return comfy_inproc.tiny_unet(seed=3)


def _inputs(seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, 8, 8, generator=g), torch.tensor([10.0, 700.0][:batch]),
            torch.randn(batch, 7, 768, generator=g))


def _run(unet, seed=0):
    x, t, ctx = _inputs(seed)
    with torch.inference_mode():
        return unet(x, t, context=ctx, transformer_options={})


def _snapshot(unet):
    return {
        "keys": list(unet.state_dict().keys()),
        # not data_ptr: the streamer moves a streamed tensor's host data into its own (pinned) buffer for good
        "params": [(n, id(p), p.device, p.dtype, p.shape, p.stride()) for n, p in unet.named_parameters()],
        "values": {n: p.detach().clone() for n, p in unet.named_parameters()},
        "hooks": [(n, len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in unet.named_modules()],
    }


def _assert_same(a, b):
    assert a["keys"] == b["keys"] and a["params"] == b["params"] and a["hooks"] == b["hooks"]
    assert all(torch.equal(a["values"][k], b["values"][k]) for k in a["values"])


def _names(unet):
    return [n for n, _ in stream_units(unet)]


def test_block_names_are_the_planners(unet):
    assert _names(unet) == [n for n, _ in unet_block_sizes(unet)]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_streaming_every_block_gives_the_same_output(unet, depth):
    """Depth 0 makes the ring as large as the largest block, so the blocks overwrite each other: a block read
    before its copy landed, or a copy landing on a block still to be read, changes the output."""
    ref = _run(unet)
    before = _snapshot(unet)
    with BlockStreamer(unet, _names(unet), prefetch_depth=depth, device="cpu") as s:
        out1 = _run(unet)
        out2 = _run(unet, seed=1)
        stats = dict(s.stats)
        ring, largest = s.ring_bytes, max(s._state[n].nbytes for n in _names(unet))
    assert torch.equal(out1, ref)
    assert torch.equal(out2, _run(unet, seed=1))
    n = len(_names(unet))
    assert stats["copies"] == 2 * n and stats["steps"] == 2 and stats["demand_loads"] == 0
    assert (ring == largest) == (depth == 0)
    _assert_same(before, _snapshot(unet))


def test_install_remove_round_trip_keeps_parameters_and_state_dict(unet):
    before = _snapshot(unet)
    s = BlockStreamer(unet, _names(unet)[::2], prefetch_depth=1, device="cpu").install()
    token = residency.token_of(unet)
    assert token is not None and residency.streamer_of(unet) is s
    s.install()                       # idempotent
    assert residency.token_of(unet) is token
    _run(unet)
    s.remove()
    s.remove()                        # idempotent
    _assert_same(before, _snapshot(unet))
    assert residency.token_of(unet) is None and s.ring_bytes == 0 and not s.installed
    s.install()                       # a new install: a new token (graphs of the old ring never replay)
    assert residency.token_of(unet) not in (None, token)
    s.remove()


def test_streamed_tensors_live_in_the_ring_while_installed(unet):
    names = _names(unet)
    blocks = dict(stream_units(unet))
    p = next(blocks["middle_block.0"][0].parameters())
    s = BlockStreamer(unet, names, prefetch_depth=1, device="cpu").install()
    try:
        lo = s.ring.data_ptr()
        assert lo <= p.data_ptr() < lo + s.ring_bytes
        assert all((q.data_ptr() - lo) % 256 == 0 for q in unet.parameters())   # every place aligned
        flat = s._state["middle_block.0"].host_flat
    finally:
        s.remove()
    assert flat.data_ptr() <= p.data_ptr() < flat.data_ptr() + flat.numel()     # back on the host buffer


def test_the_models_host_copies_are_freed_not_duplicated():
    """The streamer's host buffer of a block (pinned on a GPU machine) replaces the model's own host copies of
    the block's tensors instead of sitting beside them (SDXL at 4 GiB: ~2.3 GiB of weights were held twice).
    A second install with the same cache reuses the buffers without copying."""
    import gc
    import weakref
    unet = comfy_inproc.tiny_unet(seed=4)
    ref = _run(unet)
    freed = []
    for p in unet.parameters():
        weakref.finalize(p.untyped_storage(), freed.append, 1)
    n_params = len(list(unet.parameters()))
    cache = {}
    s = BlockStreamer(unet, _names(unet), prefetch_depth=1, device="cpu", pinned_cache=cache).install()
    gc.collect()
    assert len(freed) == n_params                  # every original storage gone once the streamer installed
    flats = {n: b.host_flat for n, b in s._state.items()}
    s.remove()
    by_range = sorted((f.data_ptr(), f.data_ptr() + f.numel()) for f in flats.values())
    for q in unet.parameters():                    # every tensor's host data now lies in one of the buffers
        assert any(lo <= q.data_ptr() < hi for lo, hi in by_range)
    assert torch.equal(_run(unet), ref)
    s2 = BlockStreamer(unet, _names(unet), prefetch_depth=1, device="cpu", pinned_cache=cache).install()
    try:
        assert all(s2._state[n].host_flat is f for n, f in flats.items())    # reused, not rebuilt
        assert torch.equal(_run(unet), ref)
    finally:
        s2.remove()


def test_host_writes_and_replaced_tensors_between_installs_reach_the_ring():
    """Between runs a host patches weights: in place (which now writes the streamer's buffer itself, so it is
    reused) or by giving a tensor new data (that block's buffer is rebuilt from it, the others reused)."""
    unet = comfy_inproc.tiny_unet(seed=5)
    cache, names = {}, _names(unet)
    blocks = dict(stream_units(unet))

    def install_run():
        s = BlockStreamer(unet, names, prefetch_depth=1, device="cpu", pinned_cache=cache).install()
        try:
            return _run(unet), {n: b.host_flat for n, b in s._state.items()}
        finally:
            s.remove()

    _, flats = install_run()
    p = owned_tensors(blocks["middle_block.0"])[0][1]
    with torch.no_grad():
        p.add_(1.0)
    expect = _run(unet)                              # eager, from the written host data
    out, again = install_run()
    assert torch.equal(out, expect) and all(again[n] is flats[n] for n in names)
    q = owned_tensors(blocks["out"])[0][1]
    q.data = q.data * 0.5                            # new data for one tensor (what set_attr_param amounts to)
    expect = _run(unet)
    out, third = install_run()
    assert torch.equal(out, expect)
    assert third["out"] is not flats["out"] and third["middle_block.0"] is flats["middle_block.0"]


def test_channels_last_weights_keep_their_strides():
    conv = torch.nn.Conv2d(8, 16, 3)
    conv.weight.data = conv.weight.data.to(memory_format=torch.channels_last)
    unet = torch.nn.Module()
    unet.input_blocks = torch.nn.ModuleList([conv])
    stride = conv.weight.stride()
    with BlockStreamer(unet, ["input_blocks.0"], device="cpu"):
        assert conv.weight.stride() == stride
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_ring_is_the_planners_and_places_never_collide(unet, depth):
    sizes = unet_block_sizes(unet)
    full = sum(b for _, b in sizes)
    plan = plan_residency(sizes, (min_budget(sizes, 0, depth) + full) // 2, 0, depth)
    s = BlockStreamer(unet, plan.streamed, prefetch_depth=depth, device="cpu").install()
    try:
        act = s._active
        nbytes = [s._state[n].nbytes for n in act]
        places = [s._state[n].place for n in act]
        assert (places, s.ring_bytes) == ring_layout(nbytes, depth)
        # the ring of padded sizes is the planner's ring of parameter bytes, plus the padding
        assert 0 <= s.ring_bytes - (plan.peak_bytes - plan.resident_bytes) < 256 * 200
        for i in range(len(act)):
            for j in range(max(0, i - depth), i):
                assert places[i] >= places[j] + nbytes[j] or places[j] >= places[i] + nbytes[i], (i, j)
    finally:
        s.remove()


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_order_is_the_plans(unet, depth):
    sizes = unet_block_sizes(unet)
    full = sum(b for _, b in sizes)
    floor = min_budget(sizes, 0, depth)
    plan = plan_residency(sizes, (floor + full) // 2, 0, depth)   # some resident, some streamed
    assert plan.resident and len(plan.streamed) > depth + 1
    s = BlockStreamer(unet, plan.streamed, prefetch_depth=depth, device="cpu").install()
    held = []
    probes = [m.register_forward_pre_hook(lambda m, a: held.append(len(s.live_blocks())))
              for m in unet.modules() if m._parameters]
    try:
        _run(unet)
        first = list(s.prefetch_log)
        _run(unet)
        second = s.prefetch_log[len(first):]
    finally:
        for h in probes:
            h.remove()
        s.remove()
    # every step: the planner's (block, issued during) pairs, once each, in execution order
    assert first == second == [tuple(p) for p in plan.prefetch]
    assert held and max(held) <= 1 + depth + depth   # one computing, d in flight, d kept before overwrite


def test_blocks_out_of_order_are_loaded_on_demand(unet):
    """A block called outside the step (as a ControlNet-style extension or a cache node might) still reads its
    own weights: its copy is issued when it is entered, and a prefetched copy it overwrote is issued again."""
    names = _names(unet)
    blocks = dict(stream_units(unet))
    x, t, ctx = _inputs()
    last = blocks["out"][0]
    with torch.inference_mode():
        h = torch.randn(2, last[0].num_channels, 8, 8)
        ref = last(h)
        with BlockStreamer(unet, names, prefetch_depth=0, device="cpu") as s:
            _run(unet)
            blocks["input_blocks.0.0"][0](x)  # loads input_blocks.0.0 over the shared place
            out = last(h)                   # out was loaded at the end of the step: overwritten, loaded again
            assert s.stats["demand_loads"] == 0 and s.prefetch_log[-1] == ("out", "out")
    assert torch.equal(out, ref)


def test_comfy_cast_weights_path_streams_too():
    """manual_cast modules (ComfyUI's cast path, as for partially loaded weights) read the swapped tensors."""
    import comfy.ops
    unet = comfy_inproc.tiny_unet(seed=4, operations=comfy.ops.manual_cast)
    assert any(getattr(m, "comfy_cast_weights", False) for m in unet.modules())
    ref = _run(unet)
    with BlockStreamer(unet, _names(unet), prefetch_depth=1, device="cpu"):
        out = _run(unet)
    assert torch.equal(out, ref)


def test_error_mid_step_then_remove_restores(unet):
    before = _snapshot(unet)
    blocks = dict(stream_units(unet))
    s = BlockStreamer(unet, _names(unet), prefetch_depth=1, device="cpu").install()

    def boom(m, a):
        raise RuntimeError("out of memory (injected)")
    h = blocks["output_blocks.1.0"][0].register_forward_pre_hook(boom)   # its ResBlock
    try:
        with pytest.raises(RuntimeError, match="injected"):
            _run(unet)
    finally:
        h.remove()
    assert s.live_blocks()            # the step stopped with copies issued
    out = _run(unet)                  # the next step still right
    s.remove()
    _assert_same(before, _snapshot(unet))
    assert torch.equal(out, _run(unet))


def test_bad_arguments(unet):
    with pytest.raises(ValueError, match="not stream units"):
        BlockStreamer(unet, ["input_blocks.99"], device="cpu")
    with pytest.raises(ValueError):
        BlockStreamer(unet, [], prefetch_depth=-1, device="cpu")


def test_off_device_bytes_counts_what_the_host_left_behind(unet):
    on_cpu = off_device_bytes(unet, "cpu")
    assert set(on_cpu.values()) == {0}
    meta = off_device_bytes(unet, "meta")     # every tensor is "elsewhere" from a meta device's view
    assert meta == dict(unet_block_sizes(unet))


def test_channels_last_conversion_of_streamed_conv_weights_goes_through_the_ring():
    """The Accelerated KSampler converts conv weights to channels_last in place on its first GPU step, which
    may come after the streamer installed: a plain `.data =` there would give the weight a copy of whatever
    its ring place held then (device run 18: a wrong image). Through the streamer the host copy and the
    ring view change layout together and the output stays the same."""
    from sd_accel.engine.patches import patching
    unet = comfy_inproc.tiny_unet(seed=6)
    ref = _run(unet)
    values = {n: p.detach().clone() for n, p in unet.named_parameters()}
    convs = [m for m in unet.modules() if isinstance(m, torch.nn.Conv2d)]
    with BlockStreamer(unet, _names(unet), prefetch_depth=1, device="cpu") as s:
        _run(unet)                                    # the ring holds the last block's weights now
        assert patching.convert_conv_weights(unet) == len(convs)
        assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
        lo = s.ring.data_ptr()
        assert all(lo <= m.weight.data_ptr() < lo + s.ring_bytes for m in convs)
        out = _run(unet)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # after remove: the host copies keep the new layout (later runs start from it), values unchanged
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    assert all(torch.equal(p, values[n]) for n, p in unet.named_parameters())
