"""engine/reports/vram_report.py on CPU: stages recorded with None values and a reason, JSON-able, one line."""
import json

import pytest
import torch

from sd_accel.engine.reports.vram_report import MemoryReport


def test_cpu_stage_has_none_values_and_a_reason():
    r = MemoryReport()
    with r.stage("sampling", device="cpu"):
        torch.ones(4) * 2
    (s,) = r.to_dict()["stages"]
    assert s["stage"] == "sampling" and s["error"] is None
    assert s["peak_allocated"] is None and s["peak_reserved"] is None and s["fragmentation"] is None
    assert s["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_no_cuda_reason_without_device():
    r = MemoryReport()
    with r.stage("text encode"):
        pass
    assert "CUDA not available" in r.to_dict()["stages"][0]["reason"]


def test_stages_in_order_json_and_summary():
    r = MemoryReport()
    for name in ("text encode", "sampling", "VAE decode"):
        with r.stage(name, device="cpu"):
            pass
    with r.stage("sampling", device="cpu"):   # a re-run replaces the stage, moved to the end
        pass
    d = json.loads(json.dumps(r.to_dict()))
    assert [s["stage"] for s in d["stages"]] == ["text encode", "VAE decode", "sampling"]
    line = r.summary()
    assert "\n" not in line and line.startswith("memory: ") and "sampling: n/a (" in line


def test_error_in_stage_is_recorded_and_raised():
    r = MemoryReport()
    with pytest.raises(RuntimeError):
        with r.stage("VAE decode", device="cpu"):
            raise RuntimeError("boom")
    assert r.to_dict()["stages"][0]["error"] == "RuntimeError"
    assert "ended with RuntimeError" in r.summary()


def test_empty_and_recorded_cuda_values_summary():
    r = MemoryReport()
    assert r.summary() == "memory: no stage recorded"
    r.record({"stage": "sampling", "peak_allocated": 2 * 2 ** 30, "peak_reserved": 3 * 2 ** 30,
              "fragmentation": 1.5, "reason": None, "error": None})
    assert "peak 2.00 GiB allocated, 3.00 GiB reserved, fragmentation 1.50x" in r.summary()
