"""What the kernels read from the device: the SM count sizes group_norm_silu's grids, read from the
device's properties (once per device), and a stand-in count where there is no GPU (the interpreter)."""
import types

import torch

from sd_accel.kernels import _device


def test_the_sm_count_is_read_from_the_device_once(monkeypatch):
    reads = []

    def properties(index):
        reads.append(index)
        return types.SimpleNamespace(multi_processor_count=28 if index == 1 else 132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_device, "_sms", {})
    assert _device.sm_count(torch.device("cuda", 1)) == 28
    assert _device.sm_count(torch.device("cuda", 1)) == 28
    assert _device.sm_count(torch.device("cuda")) == 132        # the current device
    assert reads == [1, 0]


def test_without_a_gpu_grids_are_sized_for_the_stand_in_count():
    assert _device.sm_count(torch.device("cpu")) == _device.SMS_WITHOUT_A_GPU
