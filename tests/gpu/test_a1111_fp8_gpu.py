"""precision fp8 (LOSSY) on A1111's ldm UNet on the GPU machine (hosts/a1111_fp8.py): through the CUDA-graph call
A1111's "SD Unet" hook makes, under autocast as A1111 runs fp16 UNets, with A1111's Lora extension (its stand-in,
tests/hosts/a1111/lora_standin.py) changing networks between runs: each run near the fp16 UNet with the same
network, never the FP8 weights of an earlier one, graphs replayed. `python3 -m pytest tests/gpu/test_a1111_fp8_gpu.py`."""
import os
import sys
import types

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "hosts", "a1111"))
sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "dev"))

from ldm_without_omegaconf import provide_list_config  # noqa: E402

provide_list_config()

import lora_standin  # noqa: E402
from unet_util import make_unet, unet_inputs  # noqa: E402

FP8_GPU = torch.cuda.get_device_capability() in ((8, 9), (9, 0))
# the small random UNet's output, its four GEGLU projections in FP8 vs fp16 (0.13 measured: 16 tokens per image
# give the per-token scales little to average)
FP8_TOL = 0.2


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.skipif(not FP8_GPU, reason="FP8 compute needs sm_89/sm_90 (the refusal is tested on the CPU)")
def test_lora_changes_through_graphs_never_replay_stale_fp8_weights(monkeypatch):
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    from sd_accel.hosts import a1111, a1111_graph_route
    unet = make_unet().cuda().half()
    nets = lora_standin.install(unet, monkeypatch)
    x, t, ctx = (v.cuda() for v in unet_inputs(batch=2))
    proj = [n for n, _ in unet.named_modules() if n.endswith("ff.net.0.proj")]
    g = torch.Generator().manual_seed(9)

    def network(name):
        deltas = {p: (0.3 * torch.randn(a1111.patching.get_attr(unet, p).weight.shape, generator=g)).cuda()
                  for p in proj}
        return lora_standin.Network(name, deltas)

    loras = {"none": [], "a": [network("a")], "b": [network("b")]}
    order = ("a", "b", "none", "a")

    def stock(name):
        nets.loaded_networks[:] = loras[name]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            return unet(x, t, context=ctx).float()

    refs = {name: stock(name) for name in loras}
    assert min(_rel(refs[a], refs[b]) for a in loras for b in loras if a < b) > 3 * FP8_TOL
    s = a1111.apply(unet, a1111.A1111Options(precision="fp8"))
    assert s["precision"] == "fp8" and s["counts"]["fp8_linear"] == len(proj), s
    for name in order:
        nets.loaded_networks[:] = loras[name]
        a1111.new_sampling_run(types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=unet)))
        outs = []
        for _ in range(4):      # warm-up after the weights changed, capture, replays
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                outs.append(a1111_graph_route.graph_forward(unet, UNetModel.forward, x, t, ctx).float())
        errs = {other: _rel(outs[-1], ref) for other, ref in refs.items()}
        assert errs[name] < FP8_TOL and all(e > 2 * FP8_TOL for o, e in errs.items() if o != name), (name, errs)
        assert torch.equal(outs[-1], outs[-2]), name
    graphs = a1111.status(unet)["graphs"]
    assert graphs["replays"] >= 2 * len(order) and graphs["invalidations"] >= len(order) - 1, graphs
    a1111.remove(unet)
    assert _rel(stock("a"), refs["a"]) < 1e-3     # the stock UNet again, LoRA and all (cuDNN may pick other algorithms)


@pytest.mark.skipif(not FP8_GPU, reason="FP8 compute needs sm_89/sm_90")
def test_switching_to_fp8_after_fp16_graphs_captures_again():
    """The setting changed between generations: the fp16 graphs are dropped and the FP8 step warms up eagerly
    (its kernels and weights made outside a capture), then captures and replays."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    from sd_accel.hosts import a1111, a1111_graph_route
    unet = make_unet().cuda().half()
    x, t, ctx = (v.cuda() for v in unet_inputs(batch=2))

    def steps(n):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            return [a1111_graph_route.graph_forward(unet, UNetModel.forward, x, t, ctx).float() for _ in range(n)]

    a1111.apply(unet, a1111.A1111Options())
    fp16 = steps(4)[-1]
    assert a1111.status(unet)["graphs"]["replays"] >= 2
    a1111.apply(unet, a1111.A1111Options(precision="fp8"))
    fp8 = steps(4)
    g = a1111.status(unet)["graphs"]
    assert g["captures"] == 1 and g["replays"] >= 2 and "capture failed" not in str(g), g
    assert torch.equal(fp8[-1], fp8[-2]) and 0 < _rel(fp8[-1], fp16) < FP8_TOL
    a1111.remove(unet)
