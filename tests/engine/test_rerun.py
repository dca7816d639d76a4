"""engine/graphs/rerun.py: a call's containers put back as they were given, by identity."""
import torch

from sd_accel.engine.graphs.rerun import Containers


def test_restore_puts_back_the_items_of_the_same_objects_nested_and_shared():
    a, b = torch.ones(2), torch.zeros(2)
    inner = [a, None]
    cond = {"control": {"input": inner, "output": [b]}, "n": 3}
    args = ((cond, inner), {"to": {"patches": {}}})
    given = Containers(args)
    inner.pop()
    cond["control"]["output"] = []
    cond["extra"] = 1
    args[1]["to"].clear()
    given.restore()
    assert cond["control"]["input"] is inner and inner[0] is a and inner[1] is None and len(inner) == 2
    assert cond["control"]["output"][0] is b and "extra" not in cond and cond["n"] == 3
    assert args[1]["to"] == {"patches": {}}


def test_a_cycle_is_walked_once():
    d = {}
    d["self"] = d
    Containers(d).restore()
    assert d["self"] is d
