"""engine/vram_plan.py: which blocks stay resident for a budget, the prefetch order, the minimum budget and
its error message, and unet_block_sizes on ComfyUI's real UNetModel."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402

from sd_accel.engine.vram_plan import BudgetTooSmall, min_budget, plan_residency, unet_block_sizes  # noqa: E402

MB = 2 ** 20
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


@pytest.mark.parametrize("label, budget_mb, resident, streamed", [
    # full streaming, depth 1: largest pair of cyclically adjacent blocks = b+c = 60 -> minimum 160
    ("minimum: nothing resident", 160, [], ["a", "b", "c", "d", "e"]),
    # b (largest) resident: 40 + window over a,c,d,e (c+d = 50) = 90 -> 190
    ("largest resident first", 190, ["b"], ["a", "c", "d", "e"]),
    # b, d resident: 70 + window over a,c,e (a+c = 30) = 100 -> 200
    ("two largest", 200, ["b", "d"], ["a", "c", "e"]),
    # b, d, c resident: 90 + window(a, e) = 15 -> 205: at two streamed blocks the window is both of them,
    # so making them resident too costs nothing more and everything stays resident (205)
    ("window covers the rest", 205, ["a", "b", "c", "d", "e"], []),
])
def test_budget_decides_the_resident_set(label, budget_mb, resident, streamed):
    p = plan_residency(SIZES, budget_mb * MB, ACT)
    assert (p.resident, p.streamed) == (resident, streamed), label
    assert p.peak_bytes <= budget_mb * MB
    assert p.resident_bytes + p.streamed_bytes == 105 * MB


def test_resident_blocks_are_the_largest_that_fit():
    p = plan_residency(SIZES, 195 * MB, ACT)
    # b first; d, c, a would each need 200; the smaller e still fits (45 + window c+d 50 = 195)
    assert p.resident == ["b", "e"]
    assert p.peak_bytes == 195 * MB and p.min_budget_bytes == 160 * MB


def test_prefetch_order_depth_1_and_2():
    p = plan_residency(SIZES, 160 * MB, ACT, prefetch_depth=1)
    # each streamed block is copied while the streamed block before it computes (cyclic across steps)
    assert p.prefetch == [("a", "e"), ("b", "a"), ("c", "b"), ("d", "c"), ("e", "d")]
    p2 = plan_residency(SIZES, 190 * MB, ACT, prefetch_depth=1)
    assert p2.prefetch == [("a", "e"), ("c", "a"), ("d", "c"), ("e", "d")]   # b is resident: skipped
    p3 = plan_residency(SIZES, 300 * MB, ACT // 4, prefetch_depth=2)
    assert p3.streamed == []
    p4 = plan_residency(SIZES, min_budget(SIZES, ACT, 2), ACT, prefetch_depth=2)
    assert p4.prefetch == [("a", "d"), ("b", "e"), ("c", "a"), ("d", "b"), ("e", "c")]
    assert p4.peak_bytes == ACT + 90 * MB    # b+c+d in flight


def test_depth_0_streams_one_block_at_a_time():
    p = plan_residency(SIZES, ACT + 40 * MB, ACT, prefetch_depth=0)
    assert p.resident == [] and p.prefetch[1] == ("b", "b") and p.peak_bytes == ACT + 40 * MB


def test_min_budget_is_bounded_by_largest_block_times_depth():
    for d in (0, 1, 2, 3):
        assert min_budget(SIZES, ACT, d) <= ACT + 40 * MB * (1 + d)


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
    assert d["resident"] == ["b"] and d["prefetch"][0] == ["a", "e"]
    assert "1 blocks resident" in p.summary() and "4 streamed" in p.summary()


def test_unet_block_sizes_on_comfyui_unet():
    unet = comfy_inproc.tiny_unet()
    sizes = unet_block_sizes(unet)
    names = [n for n, _ in sizes]
    n_in, n_out = len(unet.input_blocks), len(unet.output_blocks)
    expect = (["time_embed"] + ["input_blocks.%d" % i for i in range(n_in)] + ["middle_block"]
              + ["output_blocks.%d" % i for i in range(n_out)] + ["out"])
    assert names == expect
    total = sum(p.numel() * p.element_size() for p in unet.parameters())
    assert sum(s for _, s in sizes) == total
    assert all(s > 0 for _, s in sizes)
    p = plan_residency(sizes, min_budget(sizes, 0), 0)
    assert len(p.streamed) + len(p.resident) == len(sizes)
