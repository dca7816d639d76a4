"""`graphs.eager.eager_call`: a step's first eager call compiles its Triton kernels in parallel; when any were
compiled, that pass (references in their place) is discarded with what it added to the kernel report, and
the step runs again. Triton's async compile mode is stood in for (tests/kernels/test_launch.py covers the
launch side; tests/gpu/test_compile_ahead_gpu.py the real compilation)."""
import logging

import pytest
import torch

from sd_accel.engine.reports import kernel_report
from sd_accel.engine.graphs import eager
from sd_accel.kernels import _compile_ahead, _triton
from sd_accel.kernels._dispatch import Outcome

FUSED = Outcome("triton")


@pytest.fixture
def available(monkeypatch):
    monkeypatch.setattr(_triton, "compile_ahead_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _step(calls, compiling_pass):
    def fn(x, scale=1):
        calls.append(x)
        ran = Outcome("reference", _compile_ahead.CompilingAhead.reason) if compiling_pass() else FUSED
        kernel_report.record("test_op", ran)
        return x * scale
    return fn


def test_a_pass_that_compiled_kernels_is_discarded_and_the_step_runs_again(available, monkeypatch, caplog):
    passes = []

    def fake_ahead(f):          # the first pass compiles 3 kernels (their ops run references), the next none
        passes.append("ahead")
        if len(passes) > 1:
            return f(), 0
        monkeypatch.setattr(_compile_ahead, "compiling_ahead", lambda: True)
        try:
            return f(), 3
        finally:
            monkeypatch.setattr(_compile_ahead, "compiling_ahead", lambda: False)
    monkeypatch.setattr(_triton, "run_compiling_ahead", fake_ahead)
    calls = []
    before = kernel_report.snapshot()
    with caplog.at_level(logging.INFO, logger="sd_accel"):
        out = eager.eager_call(_step(calls, lambda: _compile_ahead.compiling_ahead()), (2,), {"scale": 5})
    assert out == 10 and calls == [2, 2] and passes == ["ahead", "ahead"]
    summary = kernel_report.summarize(before, kernel_report.snapshot())
    assert summary["test_op"] == {"fused": 1, "fallback": 0, "reasons": []}   # only the kept pass counts
    assert "using the stock path" not in caplog.text


def test_a_pass_that_compiled_nothing_is_the_result(available, monkeypatch):
    monkeypatch.setattr(_triton, "run_compiling_ahead", lambda f: (f(), 0))
    calls = []
    before = kernel_report.snapshot()
    assert eager.eager_call(_step(calls, lambda: False), (3,), {}) == 3 and calls == [3]
    assert kernel_report.summarize(before, kernel_report.snapshot())["test_op"]["fused"] == 1


def test_without_the_parallel_path_under_a_budget_or_inside_a_capture_it_is_the_plain_call(monkeypatch):
    monkeypatch.setattr(_triton, "run_compiling_ahead", lambda f: pytest.fail("not a plain call"))
    monkeypatch.setattr(_triton, "compile_ahead_available", lambda: False)
    assert eager.eager_call(lambda x: x + 1, (1,), {}) == 2
    monkeypatch.setattr(_triton, "compile_ahead_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with eager.under_vram_budget():      # a VRAM Pool's budgeted run: the references' temporaries
        assert eager.eager_call(lambda x: x + 1, (1,), {}) == 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert eager.eager_call(lambda x: x + 1, (1,), {}) == 2


def test_rollback_restores_counts_and_reasons():
    before = kernel_report.snapshot()
    kernel_report.record("rolled_op", Outcome("reference", "odd shape"))
    assert "rolled_op" in kernel_report.summarize(before, kernel_report.snapshot())
    kernel_report.rollback(before)
    after = kernel_report.snapshot()
    assert kernel_report.summarize(before, after) == {} and "rolled_op" not in after[1]


def test_passes_go_on_while_they_compile_then_the_plain_call(available, monkeypatch):
    """Kernels reached only behind a kernel's result are compiled in the next pass; after AHEAD_PASSES passes
    that still compiled something, the plain call."""
    compiled_per_pass = iter([5, 2, 1, 0])
    passes = []

    def fake_ahead(f):
        passes.append(f())
        return passes[-1], next(compiled_per_pass)
    monkeypatch.setattr(_triton, "run_compiling_ahead", fake_ahead)
    calls = []
    assert eager.eager_call(_step(calls, lambda: False), (1,), {}) == 1
    assert len(passes) == eager.AHEAD_PASSES == 3 and len(calls) == 4   # 3 passes, then the plain call
    compiled_per_pass = iter([4, 0])
    passes.clear()
    calls.clear()
    eager.eager_call(_step(calls, lambda: False), (1,), {})
    assert len(passes) == 2 and len(calls) == 2                              # the second pass is the result


def test_cudnn_autotune_scope_sets_and_restores_the_flag():
    before = torch.backends.cudnn.benchmark
    seen = []
    with eager.cudnn_autotuned():
        seen.append(torch.backends.cudnn.benchmark)
    with eager.cudnn_autotuned(False):
        seen.append(torch.backends.cudnn.benchmark)
    with pytest.raises(KeyError):
        with eager.cudnn_autotuned():
            raise KeyError("x")
    assert seen == [True, before] and torch.backends.cudnn.benchmark is before


def test_autotuning_is_off_by_default_and_held_off_inside_a_budget_scope(monkeypatch):
    assert not eager.CUDNN_AUTOTUNE or "SDACCEL_CUDNN_AUTOTUNE" in __import__("os").environ
    monkeypatch.setattr(eager, "CUDNN_AUTOTUNE", True)     # SDACCEL_CUDNN_AUTOTUNE=1
    assert eager.autotune_now()
    with eager.under_vram_budget():
        with eager.under_vram_budget():
            assert not eager.autotune_now()
        assert not eager.autotune_now()
    assert eager.autotune_now()
