"""The run report names every option that was on: what ran, or what fell back and why."""
from types import SimpleNamespace

import pytest

from sd_accel.engine.reports import run_report

ALL_ON = {"fused_kernels": True, "cuda_graph": True, "channels_last": True, "attention": "auto"}
FUSED = {"group_norm_silu": {"fused": 90, "fallback": 0, "reasons": []}}


def _timer(cuda):
    """What build reads of a finished RunTimer (a CUDA one cannot run on the CPU machine)."""
    return SimpleNamespace(cuda=cuda, seconds=0.5, peak_bytes=2 ** 30 if cuda else None)


def test_channels_last_is_listed_as_ran_on_a_gpu():
    r = run_report.build(10, _timer(True), FUSED, {"captures": 1, "replays": 9, "eager": 1}, ALL_ON)
    assert r["ran"] == ["group_norm_silu x90", "cuda_graph (9 replays, 1 captures)", "channels_last"]
    assert r["fell_back"] == {}
    assert "ran: group_norm_silu x90, cuda_graph (9 replays, 1 captures), channels_last |" in run_report.one_line(r)


def test_channels_last_on_the_cpu_falls_back_and_says_why():
    with run_report.RunTimer() as timer:   # a real timer: no CUDA device on this machine
        pass
    if timer.cuda:
        pytest.skip("a CUDA device is present")
    r = run_report.build(4, timer, {}, {"captures": 0, "replays": 0, "eager": 4, "eager_reason": "no CUDA device"},
                         dict(ALL_ON, fused_kernels=False))
    assert "channels_last" not in r["ran"]
    assert r["fell_back"] == {"cuda_graph": "no CUDA device", "fused_kernels": "off",
                              "channels_last": "CPU run: conv weights are converted on a GPU only"}
    assert "channels_last: CPU run" in run_report.one_line(r)


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu", "cpu"])
def test_channels_last_off_is_reported_off(cuda):
    r = run_report.build(4, _timer(cuda), {}, {}, dict(ALL_ON, channels_last=False))
    assert "channels_last" not in r["ran"] and r["fell_back"]["channels_last"] == "off"


def test_a_chosen_attention_backend_is_named_whether_or_not_it_was_called():
    called = {"attention_sdpa": {"fused": 32, "fallback": 0, "reasons": []}}
    r = run_report.build(2, _timer(False), called, {}, dict(ALL_ON, attention="sdpa"))
    assert "attention_sdpa x32" in r["ran"] and "attention_sdpa" not in r["fell_back"]
    r = run_report.build(2, _timer(False), {}, {}, dict(ALL_ON, attention="sdpa"))
    assert r["fell_back"]["attention_sdpa"] == "no attention call went through it"
    r = run_report.build(2, _timer(False), {}, {}, ALL_ON)   # auto: the host's own, nothing of ours to name
    assert not [k for k in list(r["fell_back"]) + r["ran"] if k.startswith("attention")]


def test_refused_calls_are_one_line_each_with_their_counts():
    graphs = {"captures": 1, "replays": 15, "eager": 6, "stock_path": 4,
              "refused": {"reads a GPU value on the host (item at nodes_easycache.py:165 (is_past_end_timestep))": 4}}
    r = run_report.build(20, _timer(True), FUSED, graphs, ALL_ON)
    assert r["fell_back"]["cuda_graph (some calls)"] == (
        "reads a GPU value on the host (item at nodes_easycache.py:165 (is_past_end_timestep)) (4 calls, eager)")
    assert r["fell_back"]["fused kernels (some calls)"].startswith("4 step calls ran the stock modules")
    only_eager = {"captures": 0, "replays": 0, "eager": 20, "stock_path": 20,
                  "refused": {"changes Python state between calls (counter)": 18}, "eager_reason": "x"}
    r = run_report.build(20, _timer(True), {}, only_eager, ALL_ON)
    assert r["fell_back"]["cuda_graph"] == "changes Python state between calls (counter) (18 calls, eager)"
    assert r["fell_back"]["channels_last"] == "used inside CUDA graphs only, and none ran"
    assert "20 step calls ran the stock modules" in r["fell_back"]["fused kernels"]
