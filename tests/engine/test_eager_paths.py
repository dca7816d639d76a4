"""Where a step runs without graphs it takes the faster of the fused and the stock modules
(engine/graphs/eager.EagerPaths), measured with CUDA events per key; the CPU runs the stock modules; under autograd
the stock modules run. Calls are made under torch.no_grad, as every host makes its steps' (inference mode in
ComfyUI)."""
import pytest
import torch

from sd_accel.engine.patches import stock_path
from sd_accel.engine.graphs import eager


class _Event:
    """A CUDA event stand-in: done after `ready` queries, with a given elapsed time."""
    clock = {}

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = _Event.clock["now"]

    def query(self):
        return True

    def elapsed_time(self, end):
        return end.t - self.t


@pytest.fixture(autouse=True)
def without_autograd():
    with torch.no_grad():
        yield


def test_on_the_cpu_the_stock_modules_run_unless_the_kernels_are_interpreted(monkeypatch):
    seen = []
    paths = eager.EagerPaths()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    paths.run(("k",), lambda: seen.append(stock_path.active()), (), {}, torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    paths.run(("k",), lambda: seen.append(stock_path.active()), (), {}, torch.device("cpu"))
    assert seen == [True, False] and not stock_path.active()


def test_both_paths_are_timed_then_the_faster_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    cost = {"fused": 3.0, "stock": 2.0}        # host-bound: stock faster here
    seen = []

    def step():
        path = "stock" if stock_path.active() else "fused"
        seen.append(path)
        _Event.clock["now"] += cost[path]
    _Event.clock["now"] = 0.0
    paths = eager.EagerPaths()
    for _ in range(eager.SAMPLES * 2 + 3):
        _Event.clock["now"] += 1.0
        paths.run(("shape",), step, (), {}, torch.device("cuda"))
    assert seen[:4] == ["fused", "stock", "fused", "stock"]
    assert paths.choice(("shape",)) == "stock" and seen[-3:] == ["stock"] * 3
    cost.update(fused=1.0)                       # another key, GPU-bound: the fused modules win there
    seen.clear()
    for _ in range(eager.SAMPLES * 2 + 2):
        paths.run(("big shape",), step, (), {}, torch.device("cuda"))
    assert paths.choice(("big shape",)) == "fused" and seen[-2:] == ["fused", "fused"]
    assert paths.choice(("shape",)) == "stock"


def test_under_autograd_the_stock_modules_run_unmeasured_whatever_was_chosen_or_forced(monkeypatch):
    """A training step (autograd on): the stock modules on every call, none timed, on the GPU and on the CPU, over a
    key that chose the fused path and over the diagnosis switch."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []

    def step():
        seen.append(stock_path.active())
    paths = eager.EagerPaths()
    paths.by_key[("shape",)] = eager._Timing()
    paths.by_key[("shape",)].choice = "fused"
    with torch.enable_grad():
        assert eager.under_autograd()
        paths.run(("shape",), step, (), {}, torch.device("cuda"))
        paths.run(("new shape",), step, (), {}, torch.device("cuda"))
        paths.run(("k",), step, (), {}, torch.device("cpu"))
        monkeypatch.setattr(eager, "FORCED_PATH", "fused")
        paths.run(("shape",), step, (), {}, torch.device("cuda"))
    assert seen == [True] * 4 and paths.stock_calls == 4
    assert ("new shape",) not in paths.by_key   # nothing timed
    with torch.inference_mode():
        assert not eager.under_autograd()
        paths.run(("shape",), step, (), {}, torch.device("cuda"))
    assert seen[-1] is False
