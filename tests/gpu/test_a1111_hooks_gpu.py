"""sd-webui-freeu's hook inside A1111's UNet forward (its stand-in, tests/hosts/a1111/lib_free_u) through SD Accel's
CUDA-graph route on A1111's ldm UNet: over a schedule that stops FreeU after two steps, then switched off, then on
with other settings, every call is the stock forward's with the same hook state (a replay would keep the
decision of the step it was captured at); while it is switched off, graphs replay.
`python3 -m pytest tests/gpu/test_a1111_hooks_gpu.py`."""
import os
import sys
import types

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "hosts", "a1111"))
sys.path.insert(0, os.path.join(TESTS, "hosts", "a1111", "fake_a1111"))
sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "dev"))

from ldm_without_omegaconf import provide_list_config  # noqa: E402

provide_list_config()

from unet_util import make_unet, unet_inputs  # noqa: E402

TOL = 1e-2


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_freeus_schedule_and_switch_are_never_replayed_stale(monkeypatch):
    import ldm.modules.diffusionmodules.openaimodel as om
    from modules import sd_hijack_unet
    from lib_free_u import global_state, unet as freeu_unet
    from sd_accel.hosts import a1111
    monkeypatch.setattr(om, "th", sd_hijack_unet.th)
    state = types.SimpleNamespace(enable=True, stages={32: (1.6, 0.1)}, start_step=0, stop_step=2)
    monkeypatch.setattr(global_state, "instance", state)
    remove = freeu_unet.patch()
    try:
        unet = make_unet().cuda().half()
        x, t, ctx = (v.cuda() for v in unet_inputs(batch=2))

        def stock():   # under autocast, as A1111 runs an fp16 UNet
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                return unet(x, t, context=ctx).float()

        def ours():
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                return a1111.graph_forward(unet, om.UNetModel.forward, x, t, ctx).float()

        phases = [("on, scheduled", True, {32: (1.6, 0.1)}, range(5)),
                  ("off", False, {32: (1.6, 0.1)}, range(5)),
                  ("on, other settings", True, {32: (0.7, 2.0)}, range(3))]

        def each_call():
            for name, enable, stages, steps in phases:
                state.enable, state.stages = enable, stages
                for step in steps:
                    monkeypatch.setattr(global_state, "sampling_step", step)
                    yield name, step

        refs = {call: stock() for call in each_call()}        # the stock UNet, before SD Accel is applied
        a1111.apply(unet, a1111.A1111Options())
        outs = {}
        for call in each_call():
            outs[call] = ours()
            if call == ("off", 4):
                graphs = a1111.status(unet)["graphs"]
                assert graphs["replays"] >= 2, graphs      # switched off: the graph route replays
        assert _rel(refs["on, scheduled", 0], refs["on, scheduled", 3]) > 5 * TOL   # the schedule changes the call
        assert _rel(refs["on, scheduled", 0], refs["on, other settings", 0]) > 5 * TOL
        errs = {k: _rel(outs[k], refs[k]) for k in refs}
        assert max(errs.values()) < TOL, errs
    finally:
        remove()
