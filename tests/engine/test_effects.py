"""What a step's patch functions store in their modules (tokens.write_targets), found by the probe and stored again
after each replay (engine/graphs/effects.py). Forge's Kohya HRFix patch stores the shape it leaves the features in
on `modules.shared` at every block call; Forge's SAG reads it after the step (tests/hosts/a1111/
forge_kohya_hrfix_standin.py): a replay that stored nothing would leave another step's shape there."""
import types

import pytest
import torch

from sd_accel.engine.graphs import effects, host_reads, probe, tokens

shared = types.ModuleType("modules.shared")   # stands for Forge's `modules.shared`
COUNT = 0


@pytest.fixture(autouse=True)
def watch_cpu(monkeypatch):
    monkeypatch.setattr(host_reads, "WATCHED", "cpu")
    for name in ("kohya_shrink_shape", "kohya_shrink_shape_out"):
        if hasattr(shared, name):
            delattr(shared, name)


def shrinking_patch(h, transformer_options):
    shared.kohya_shrink_shape = (h.shape[-1], h.shape[-2])
    shared.kohya_shrink_shape_out = None
    return h


def counting_patch(h, transformer_options):
    global COUNT
    COUNT += 1
    return h


def plain_patch(h, transformer_options):
    return h * 2


def _step(x, transformer_options):
    for patch in transformer_options["patches"]["input_block_patch"]:
        x = patch(x, transformer_options)
    return x


def _targets(fn):
    return [(kind, name) for kind, _, name in tokens.write_targets(fn)]


def test_the_places_a_function_stores_in_its_module_are_found_in_its_code():
    assert _targets(shrinking_patch) == [("attr", "kohya_shrink_shape"), ("attr", "kohya_shrink_shape_out")]
    assert _targets(counting_patch) == [("global", "COUNT")]
    assert _targets(plain_patch) == []

    def outer(h, to):          # a store in a function made inside the patch's code is its store too
        def inner():
            shared.kohya_shrink_shape = None
        inner()
        return h
    assert _targets(outer) == [("attr", "kohya_shrink_shape")]

    class Holder:
        flag = False
    local = Holder

    def stores_through_a_local(h, to):   # not a global's attribute: outside the module's state
        local.flag = True
        return h
    assert _targets(stores_through_a_local) == []


def test_the_probe_lets_a_patch_storing_in_its_module_capture_and_names_where():
    x = torch.randn(1, 4, 8, 6)
    options = {"patches": {"input_block_patch": [shrinking_patch, plain_patch]}}
    out, verdict = probe.probe(_step, (x, options), {}, [x])
    assert verdict.capturable, verdict.reason
    assert [(kind, held.obj, name) for kind, held, name in verdict.writes] == [
        ("attr", shared, "kohya_shrink_shape"), ("attr", shared, "kohya_shrink_shape_out")]
    assert shared.kohya_shrink_shape == (6, 8) and torch.equal(out, x * 2)

    _, verdict = probe.probe(_step, (x, {"patches": {"input_block_patch": [plain_patch]}}), {}, [x])
    assert verdict.capturable and verdict.writes == ()


def test_what_the_capture_stored_is_stored_again_over_another_steps_value():
    """The capture run's values, recorded after it, are set again after each replay, over whatever an eager call of
    another key (another shape) stored meanwhile; a value the capture left unset is unset again."""
    x = torch.randn(1, 4, 8, 6)
    _, verdict = probe.probe(_step, (x, {"patches": {"input_block_patch": [shrinking_patch]}}), {}, [x])
    shrinking_patch(x, {})                      # the capture run
    recorded = effects.record(verdict.writes)
    shrinking_patch(torch.randn(1, 4, 16, 12), {})   # another key's eager call
    shared.kohya_shrink_shape_out = (12, 16)
    assert shared.kohya_shrink_shape == (12, 16)
    effects.apply(recorded)                     # after a replay of the first key's graph
    assert shared.kohya_shrink_shape == (6, 8) and shared.kohya_shrink_shape_out is None

    del shared.kohya_shrink_shape_out
    unset = effects.record(verdict.writes)
    shared.kohya_shrink_shape_out = (1, 1)
    effects.apply(unset)
    assert not hasattr(shared, "kohya_shrink_shape_out") and shared.kohya_shrink_shape == (6, 8)


def test_a_global_counter_is_in_the_key_so_its_calls_never_share_a_graph():
    """A patch that reads what it stores (a counter) is not replayed with a stored value: the value it reads is
    in its key (global_reads), so every call is a new key, which the churn rule then refuses."""
    before = tokens.signature(counting_patch)
    counting_patch(None, None)
    assert tokens.signature(counting_patch) != before
