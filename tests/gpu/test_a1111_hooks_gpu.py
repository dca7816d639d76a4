"""Other extensions' hooks inside A1111's UNet forward through SD Accel's CUDA-graph route on A1111's ldm UNet (their
stand-ins in tests/hosts/a1111): sd-webui-freeu over a schedule that stops FreeU after two steps, then switched off,
then on with other settings; Kohya Hires.fix's block wrappers with smooth scaling, taken out after two steps. Every
call is the stock forward's with the same hook state (a replay would keep the decision of the step it was captured
at); where no hook acts, graphs replay.
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

from kohya_hiresfix_standin import Scaler  # noqa: E402
from unet_util import make_unet, unet_inputs  # noqa: E402

TOL = 1e-2


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_freeus_schedule_and_switch_are_never_replayed_stale(monkeypatch):
    import ldm.modules.diffusionmodules.openaimodel as om
    from modules import sd_hijack_unet
    from lib_free_u import global_state, unet as freeu_unet
    from sd_accel.hosts import a1111, a1111_graph_route
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
                return a1111_graph_route.graph_forward(unet, om.UNetModel.forward, x, t, ctx).float()

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


def test_kohya_hiresfix_blocks_are_never_replayed_stale(monkeypatch):
    import ldm.modules.diffusionmodules.openaimodel as om
    from modules import sd_hijack_unet
    from sd_accel.hosts import a1111, a1111_graph_route
    monkeypatch.setattr(om, "th", sd_hijack_unet.th)
    unet = make_unet().cuda().half()
    x, t, ctx = (v.cuda() for v in unet_inputs(batch=2))
    down, up = unet.input_blocks[1], unet.output_blocks[0]
    # the wrappers' scale per step (None: taken out): more scaled steps than the graph route's eager warm-up calls
    schedule = [0.5, 0.6, 0.7, 0.8, 0.9, None, None, None, None]

    def at_step(scale):   # what the extension's callback does before a step
        if scale is None:
            unet.input_blocks[1], unet.output_blocks[0] = down, up
            return
        if not isinstance(unet.input_blocks[1], Scaler):
            unet.input_blocks[1], unet.output_blocks[0] = Scaler(scale, down), Scaler(1 / scale, up)
        unet.input_blocks[1].scale, unet.output_blocks[0].scale = scale, 1 / scale

    def call(forward):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            return forward().float()

    refs = []
    for scale in schedule:
        at_step(scale)
        refs.append(call(lambda: unet(x, t, context=ctx)))
    assert _rel(refs[3], refs[-1]) > 5 * TOL and _rel(refs[2], refs[3]) > 2 * TOL
    a1111.apply(unet, a1111.A1111Options())
    a1111.new_sampling_run(types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=unet)))   # one run
    outs = []
    for scale in schedule:
        at_step(scale)
        outs.append(call(lambda: a1111_graph_route.graph_forward(unet, om.UNetModel.forward, x, t, ctx)))
    errs = [_rel(o, r) for o, r in zip(outs, refs)]
    assert max(errs) < TOL, errs
    assert a1111.status(unet)["graphs"]["replays"] >= 1, a1111.status(unet)["graphs"]   # once the wrappers are out


def test_regional_prompters_forwards_are_never_replayed_stale():
    import ldm.modules.diffusionmodules.openaimodel as om
    import regional_prompter_standin
    from sd_accel.hosts import a1111, a1111_graph_route
    unet = make_unet().cuda().half()
    x, t, ctx = (v.cuda() for v in unet_inputs(batch=2))
    calls = []
    regional_prompter_standin.hook_forwards(unet, calls)

    def call(forward):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            return forward().float()

    refs = [call(lambda: unet(x, t, context=ctx)) for _ in range(6)]    # the hooks alternate from call to call
    assert _rel(refs[0], refs[1]) > 5 * TOL
    calls.clear()
    a1111.apply(unet, a1111.A1111Options())
    a1111.new_sampling_run(types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=unet)))
    outs = [call(lambda: a1111_graph_route.graph_forward(unet, om.UNetModel.forward, x, t, ctx)) for _ in range(6)]
    errs = [_rel(o, r) for o, r in zip(outs, refs)]
    assert max(errs) < TOL, errs
