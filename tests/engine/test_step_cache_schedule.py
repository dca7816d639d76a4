"""engine/step_cache: the full steps of each mode and one run's state (which calls run cached, what it reports)."""
import pytest
import torch

from sd_accel.engine.step_cache import schedule
from sd_accel.engine.step_cache.run_state import StepCacheRun

import step_cache_reference


@pytest.mark.parametrize("n", schedule.INTERVALS)
def test_interval_n_runs_every_nth_step_in_full(n):
    assert schedule.full_steps(20, "interval %d" % n) == list(range(0, 20, n))


def test_off_runs_every_step_in_full_and_unknown_modes_are_an_error():
    assert schedule.full_steps(7, "off") == list(range(7))
    assert schedule.parse("off") is None and schedule.parse("interval 3") == (True, 3)
    assert schedule.parse("non-uniform 4") == (False, 4)
    for bad in ("interval 1", "interval", "every 3", "non-uniform x"):
        with pytest.raises(ValueError):
            schedule.parse(bad)


@pytest.mark.parametrize("total", [1, 2, 5, 10, 20, 25, 30, 50, 100])
@pytest.mark.parametrize("n", schedule.INTERVALS)
def test_non_uniform_has_the_uniform_count_of_distinct_full_steps_from_step_0(total, n):
    steps = schedule.full_steps(total, "non-uniform %d" % n)
    assert steps[0] == 0 and steps == sorted(set(steps)) and all(0 <= s < total for s in steps)
    assert len(steps) == -(-total // n) == len(schedule.full_steps(total, "interval %d" % n))


def test_non_uniform_full_steps_are_densest_around_a_quarter_of_the_run():
    steps = schedule.full_steps(50, "non-uniform 3")
    assert steps == [0, 3, 6, 8, 10, 12, 13, 14, 17, 19, 22, 26, 29, 33, 37, 41, 45]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    near = [g for a, g in zip(steps, gaps) if 8 <= a <= 17]
    assert max(near) < min(gaps[-4:]), gaps   # around step 12 denser than at the end


@pytest.mark.parametrize("mode", schedule.MODES[1:])
@pytest.mark.parametrize("total", [3, 10, 20, 37])
def test_the_tests_reference_schedule_agrees(mode, total):
    assert set(schedule.full_steps(total, mode)) == step_cache_reference.full_steps(total, mode)


def _feature():
    return torch.ones(1, 2, 3, 3)


def test_a_run_caches_between_its_full_steps_per_slot():
    run = StepCacheRun("interval 3", 6, branch=0)
    plan = []
    for step in range(6):
        for slot in ("a", "b"):
            f = run.cached_feature(slot)
            if f is None:
                run.ran_full(slot, _feature())
            else:
                run.ran_cached()
            plan.append((step, slot, "full" if f is None else "cached"))
        run.step_done()
    for slot in ("a", "b"):
        assert [k for _, sl, k in plan if sl == slot] == ["full", "cached", "cached", "full", "cached", "cached"]
    s = run.summary()
    assert (s["cached_steps"], s["full_calls"], s["cached_calls"], s["steps_reported"]) == (4, 4, 8, 6)


def test_a_new_slot_and_a_full_call_that_kept_nothing_run_in_full():
    run = StepCacheRun("interval 4", 8, branch=1)
    run.ran_full("a", _feature())
    run.step_done()
    assert run.cached_feature("a") is not None
    assert run.cached_feature("new batch shape") is None
    run.ran_full("a", None)            # the UNet never reached the branch on that call
    assert run.cached_feature("a") is None


def test_steps_past_the_schedule_run_in_full_and_release_drops_the_features():
    run = StepCacheRun("interval 5", 2, branch=0)
    run.ran_full("a", _feature())
    run.step_done()
    assert run.cached_feature("a") is not None
    run.step_done()
    run.step_done()                    # a sampler that reports more steps than the run's sigmas have
    assert run.cached_feature("a") is None
    run.release()
    assert run.features == {}


def test_a_step_with_a_full_and_a_cached_call_is_not_counted_as_cached():
    run = StepCacheRun("interval 2", 4, branch=0)
    run.ran_full("a", _feature())
    run.step_done()
    run.ran_full("b", _feature())      # step 1: a new slot runs in full, "a" runs cached
    run.ran_cached()
    run.refuse("because")
    s = run.summary()
    assert s["cached_steps"] == 0 and s["cached_calls"] == 1 and s["refused"] == {"because": 1}
