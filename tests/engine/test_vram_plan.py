"""engine/memory/vram_plan.py: which blocks stay resident for a budget, the prefetch order, the minimum budget and
its error message, one run's placement (the loader's budget, promoted blocks); engine/memory/ring.py: the ring
layout; engine/memory/stream_units.py: unet_block_sizes and stream_units on ComfyUI's real UNetModel."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402
import torch  # noqa: E402

from sd_accel.engine.memory.ring import ring_bytes, ring_layout  # noqa: E402
from sd_accel.engine.memory.stream_units import stream_units, unet_block_sizes  # noqa: E402
from sd_accel.engine.memory.vram_plan import (BudgetTooSmall, loader_budget, min_budget, place_run,  # noqa: E402
                                              plan_residency, promote_blocks)

MB = 2 ** 20
GIB = 2 ** 30
# execution order; sizes in MiB
BLOCKS = [("a", 10), ("b", 40), ("c", 20), ("d", 30), ("e", 5)]
SIZES = [(n, s * MB) for n, s in BLOCKS]
ACT = 100 * MB


def test_no_cap_keeps_everything_resident():
    p = plan_residency(SIZES, 0, ACT)
    assert p.resident == ["a", "b", "c", "d", "e"] and p.streamed == [] and p.prefetch == []
    assert p.peak_bytes == ACT + 105 * MB and p.streamed_bytes == 0


def test_budget_that_fits_everything_keeps_everything_resident():
    p = plan_residency(SIZES, ACT + 105 * MB, ACT)
    assert p.streamed == [] and p.peak_bytes == ACT + 105 * MB


def test_ring_layout_places_each_block_clear_of_the_ones_before_it():
    # depth 1: the window (largest adjacent pair) is b+c = 60; placing each block right after the one before
    # would need 70 (c wraps onto b), the search finds 60 (b at 20..60, c at 0..20, d at 20..50)
    places, ring = ring_layout([10, 40, 20, 30, 5], 1)
    assert ring == 60 and places[1:4] == [20, 0, 20]
    assert ring_layout([10, 40, 20, 30, 5], 0)[1] == 40          # one block at a time: the largest
    assert ring_layout([10, 40, 20, 30, 5], 2)[1] == 90          # b+c+d
    assert ring_layout([], 1) == ([], 0)
    import random
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice([0, 1, 5, 10, 40, 100]) for _ in range(rng.randint(1, 12))]
        d = rng.randint(0, 3)
        places, ring = ring_layout(sizes, d)
        window = max(sum(sizes[i:i + d + 1]) for i in range(len(sizes)))
        assert window <= ring <= window + max(sizes)
        for i, (p, n) in enumerate(zip(places, sizes)):
            assert 0 <= p and p + n <= ring
            for j in range(max(0, i - d), i):
                assert not (n and sizes[j] and p < places[j] + sizes[j] and places[j] < p + n), (sizes, d, i, j)


@pytest.mark.parametrize("label, budget_mb, resident, streamed", [
    # the floor, everything streamed: activations 100 + ring 60 (the window b+c) = 160
    ("floor: nothing resident", 160, [], ["a", "b", "c", "d", "e"]),
    # b (largest) resident: 40 + ring over a,c,d,e (c+d = 50) = 90 -> 190
    ("largest resident first", 190, ["b"], ["a", "c", "d", "e"]),
    # b, d resident: 70 + ring over a,c,e (a+c = 30) = 100 -> 200
    ("two largest", 200, ["b", "d"], ["a", "c", "e"]),
    # b, d, c resident: 90 + ring(a, e) = 15 -> 205: with two streamed blocks the ring holds both, so making
    # them resident too costs nothing more and everything stays resident (205)
    ("ring covers the rest", 205, ["a", "b", "c", "d", "e"], []),
])
def test_budget_decides_the_resident_set(label, budget_mb, resident, streamed):
    p = plan_residency(SIZES, budget_mb * MB, ACT)
    assert (p.resident, p.streamed) == (resident, streamed), label
    assert p.peak_bytes <= budget_mb * MB
    assert p.resident_bytes + p.streamed_bytes == 105 * MB
    assert p.min_budget_bytes == 160 * MB


def test_resident_blocks_are_the_largest_that_fit():
    p = plan_residency(SIZES, 195 * MB, ACT)
    # b first; d, c, a would each need 200; the smaller e still fits (45 + ring c+d 50 = 195)
    assert p.resident == ["b", "e"] and p.peak_bytes == 195 * MB


def test_prefetch_order_depth_0_1_and_2():
    p = plan_residency(SIZES, 160 * MB, ACT, prefetch_depth=1)
    # the step starts with the first two streamed blocks' copies; each later one is copied while the block
    # before the one before it computes (into the place that block freed)
    assert p.prefetch == [("a", None), ("b", None), ("c", "b"), ("d", "c"), ("e", "d")]
    p2 = plan_residency(SIZES, 190 * MB, ACT, prefetch_depth=1)
    assert p2.prefetch == [("a", None), ("c", None), ("d", "c"), ("e", "d")]   # b is resident: skipped
    p4 = plan_residency(SIZES, min_budget(SIZES, ACT, 2), ACT, prefetch_depth=2)
    assert p4.prefetch == [("a", None), ("b", None), ("c", None), ("d", "b"), ("e", "c")]
    assert p4.peak_bytes == ACT + 90 * MB    # b+c+d in flight
    p0 = plan_residency(SIZES, ACT + 40 * MB, ACT, prefetch_depth=0)
    assert p0.resident == [] and p0.prefetch[:2] == [("a", None), ("b", "b")] and p0.peak_bytes == ACT + 40 * MB


def test_min_budget_is_bounded_by_largest_block_times_depth():
    for d in (0, 1, 2, 3):
        assert ACT + 40 * MB <= min_budget(SIZES, ACT, d) <= ACT + 40 * MB * (2 + d)


def test_budget_too_small_says_minimum_and_given():
    with pytest.raises(BudgetTooSmall) as ei:
        plan_residency(SIZES, 150 * MB, ACT)
    e = ei.value
    assert e.needed == 160 * MB and e.given == 150 * MB
    msg = str(e)
    assert "0.15 GiB" in msg and "at least 0.16 GiB" in msg and "largest block" in msg


def test_bad_arguments():
    with pytest.raises(ValueError):
        plan_residency(SIZES, 0, ACT, prefetch_depth=-1)
    with pytest.raises(ValueError):
        plan_residency([("a", 1), ("a", 2)], 0, 0)


def test_plan_is_json_able():
    import json
    p = plan_residency(SIZES, 190 * MB, ACT)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["resident"] == ["b"] and d["prefetch"][0] == ["a", None]
    assert "1 blocks resident" in p.summary() and "4 streamed" in p.summary()


def test_unet_block_sizes_on_comfyui_unet():
    unet = comfy_inproc.tiny_unet()
    sizes = unet_block_sizes(unet)
    names = [n for n, _ in sizes]
    assert names == [n for n, _ in stream_units(unet)]
    assert names[0] == "time_embed" and names[-1] == "out" and "middle_block.0" in names
    total = sum(p.numel() * p.element_size() for p in unet.parameters())
    assert sum(s for _, s in sizes) == total
    assert all(s > 0 for _, s in sizes)
    p = plan_residency(sizes, min_budget(sizes, 0), 0)
    assert len(p.streamed) + len(p.resident) == len(sizes)


def test_stream_units_partition_the_unet_and_each_runs_once_in_order():
    """Each unit is entered once per forward, in the listed order (its modules run one after another), and
    every parameter is in exactly one unit: what the streamer's ring places and prefetch order rely on. The
    transformers are cut into their blocks, their norm/proj_in with the ResBlock before, proj_out with the last."""
    unet = comfy_inproc.tiny_unet()
    units = stream_units(unet)
    owner = {}
    for name, mods in units:
        for m in mods:
            for p in m.parameters():
                assert id(p) not in owner, (name, owner.get(id(p)))
                owner[id(p)] = name
    assert len(owner) == len(list(unet.parameters()))
    st = unet.input_blocks[1][1]
    assert st.norm in dict(units)["input_blocks.1.0"] and st.proj_in in dict(units)["input_blocks.1.0"]
    last = "input_blocks.1.1.transformer_blocks.%d" % (len(st.transformer_blocks) - 1)
    assert st.proj_out in dict(units)[last]
    entered = []
    hooks = []
    for name, mods in units:
        for m in mods:
            for sub in m.modules():
                if sub._parameters:
                    hooks.append(sub.register_forward_pre_hook(
                        lambda mod, a, name=name: entered.append(name) if not entered or entered[-1] != name else None))
    try:
        x, t, ctx = comfy_inproc.unet_inputs(unet)
        with torch.no_grad():
            unet(x, t, context=ctx)
    finally:
        for h in hooks:
            h.remove()
    assert entered == [n for n, _ in units]


def test_loader_budget_leaves_room_for_the_streamed_blocks():
    sizes = [("a", GIB // 4), ("b", GIB // 2), ("c", GIB // 4), ("d", GIB)]
    plan = plan_residency(sizes, 0, GIB // 4)
    at2 = plan_residency(sizes, 2 * GIB, GIB // 4)
    window = at2.peak_bytes - at2.activation_bytes - at2.resident_bytes
    # ComfyUI's loader subtracts its own 0.8 GiB reserve: shown that much more, it loads the planned residency
    reserve = int(0.8 * GIB)
    assert loader_budget(plan, 2 * GIB, reserve) == 2 * GIB - window - GIB // 4 + reserve
    assert loader_budget(plan, 0, reserve) == 0
    # never above the budget, even where ComfyUI's reserve is larger than what the step needs besides weights
    assert loader_budget(plan, 8 * GIB, reserve) == 8 * GIB
    assert loader_budget(plan, 8 * GIB, 0) == 8 * GIB - GIB // 4


def test_promote_blocks_fills_the_room_largest_first():
    sizes = [("a", 10 * MB), ("b", 40 * MB), ("c", 20 * MB), ("d", 30 * MB), ("e", 5 * MB)]
    assert promote_blocks(sizes, 0, 1) == [] and promote_blocks(sizes, -5, 1) == [] and promote_blocks([], 9, 1) == []
    assert promote_blocks(sizes, 50 * MB, 1) == []          # the ring of all (60) does not fit: nothing moves
    for room in (60, 90, 100, 105, 200):
        chosen = promote_blocks(sizes, room * MB, 1)
        rest = [b for n, b in sizes if n not in chosen]
        assert sum(b for n, b in sizes if n in chosen) + ring_bytes(rest, 1) <= room * MB, room
    assert promote_blocks(sizes, 90 * MB, 1) == ["b"]       # b + ring(a, c, d, e) = 40 + 50
    assert promote_blocks(sizes, 105 * MB, 1) == ["a", "b", "c", "d", "e"]


def test_a_runs_placement_is_the_nodes_plan_at_its_budget_and_replans_only_for_a_retry(monkeypatch):
    from sd_accel.engine.memory import vram_plan
    sizes = [("a", GIB // 4), ("b", GIB // 2), ("c", GIB // 4), ("d", GIB)]
    plan = plan_residency(sizes, 2 * GIB, GIB // 4)
    reserve = int(0.8 * GIB)
    expected = {b: loader_budget(plan, b, reserve) for b in (2 * GIB, 3 * GIB)}
    planned = []
    monkeypatch.setattr(vram_plan, "plan_residency", lambda *a: planned.append(a) or plan_residency(*a))
    run = place_run(plan, 2 * GIB, True, reserve)
    assert planned == []                                    # the node's plan is the run's: no planning again
    assert (run.budget_bytes, run.loader_bytes) == (2 * GIB, expected[2 * GIB])
    assert (run.prefetch_depth, run.activation_bytes) == (plan.prefetch_depth, plan.activation_bytes)
    assert place_run(plan, 3 * GIB, True, reserve).loader_bytes == expected[3 * GIB] and len(planned) == 1
    assert place_run(plan, 2 * GIB, False, reserve).loader_bytes == 2 * GIB   # no streaming: the budget itself
    bare = place_run(None, 2 * GIB, True)
    assert (bare.loader_bytes, bare.prefetch_depth, bare.activation_bytes) == (2 * GIB, vram_plan.PREFETCH_DEPTH, 0)


def test_after_the_load_the_room_left_takes_the_largest_streamed_blocks():
    from sd_accel.engine.memory import vram_plan
    run = vram_plan.RunPlacement(budget_bytes=400 * MB, loader_bytes=300 * MB, prefetch_depth=1,
                                 activation_bytes=20 * MB)
    assert run.run_activation_bytes() == 30 * MB and run.run_activation_bytes(40 * MB) == 60 * MB
    off = {"a": 10 * MB, "b": 40 * MB, "r": 0, "c": 20 * MB, "d": 30 * MB, "e": 5 * MB}   # r: loaded whole
    act, allocated = 30 * MB, 250 * MB
    ring = ring_bytes([b for b in off.values() if b], 1)
    assert run.overflow(act, allocated, off) == act + allocated + ring - 400 * MB < 0           # it fits
    assert run.overflow(act, 350 * MB, off) == act + 350 * MB + ring - 400 * MB > 0    # ComfyUI is to unload that
    assert vram_plan.RunPlacement(0, 0, 1, 0).overflow(act, allocated, off) == 0       # no cap: nothing to unload
    streamed, promoted, peak = run.after_load(act, allocated, off)
    room = int(400 * MB * (1 - vram_plan.PROMOTE_MARGIN)) - act - allocated
    assert promoted == promote_blocks([(n, b) for n, b in off.items() if b], room, 1) and promoted
    assert streamed == [n for n in ("a", "b", "c", "d", "e") if n not in promoted]
    assert peak == act + allocated + sum(off[n] for n in promoted) + ring_bytes([off[n] for n in streamed], 1)


def test_plans_are_memoized_but_each_call_gets_its_own_copy():
    """The VRAM Pool plans the same placement at every prompt: the second call is served from the cache, and a
    caller changing its plan's lists does not change what the next caller gets."""
    sizes = [("u%d" % i, (i % 7 + 1) * MB) for i in range(60)]
    a = plan_residency(sizes, 120 * MB, 10 * MB, 1)
    a.resident.append("junk")
    a.streamed.clear()
    a.sizes["u0"] = -1
    b = plan_residency(sizes, 120 * MB, 10 * MB, 1)
    assert "junk" not in b.resident and b.streamed and b.sizes["u0"] == MB
    assert b.peak_bytes <= 120 * MB
    assert ring_layout([3, 5, 2], 1) == ring_layout([3, 5, 2], 1)
    off, ring = ring_layout([3, 5, 2], 1)
    off.append(99)
    assert ring_layout([3, 5, 2], 1)[0] == off[:-1]
