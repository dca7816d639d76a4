"""GPU only: lowvram block streaming (VRAM Pool) under the Accelerated KSampler's CUDA graphs. The streamed
blocks' copies into the GPU ring are captured with the step and replayed; a replay that copied the wrong
block, or read a place before its copy landed, gives another image. Every block is streamed (the pool's
test switch `stream_every_block`: the small model would otherwise fit whole), the image is compared with
stock's, and a second prompt replays without recapturing."""
import torch

from sd_accel.engine.memory import residency
from test_graphs_gpu import _rel, _sample, comfy_env  # noqa: F401  (the shared module fixture)


def _pool(env):
    import comfy.patcher_extension as pe
    from sd_accel.hosts.comfyui.memory import WRAPPER_KEY
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    clone = SDAccelVRAMPool().apply(env.model, budget_gib=0.0, offload="lowvram")["result"][0]
    settings = clone.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)[0].sd_accel_pool
    settings.stream_every_block = True
    return clone, settings


def test_streamed_blocks_replay_in_graphs_and_match_stock(comfy_env):  # noqa: F811
    ref, _ = _sample(comfy_env, comfy_env.model, ours=False)
    clone, settings = _pool(comfy_env)
    eager, _ = _sample(comfy_env, clone, ours=False)          # the streaming alone, ComfyUI's KSampler
    assert _rel(eager, ref) < 1e-3, _rel(eager, ref)
    notes = " ".join(settings.last_notes)
    n = len(settings.last_streamer.blocks)
    assert ("lowvram: %d of %d blocks streamed" % (n, n)) in notes, notes
    for prompt in range(2):
        out, report = _sample(comfy_env, clone)
        assert _rel(out, ref) < 2e-2, (prompt, _rel(out, ref), report)
        graphs = report["graphs"]
        assert graphs["replays"] >= 4, (graphs, report["fell_back"])   # 6 steps: warm-up, capture, replays
        notes = " ".join(settings.last_notes)
        assert ("%d of %d blocks streamed" % (n, n)) in notes, notes
    # the unet is left as it was: weights back on the GPU where ComfyUI put them, no token
    unet = clone.model.diffusion_model
    assert all(p.is_cuda for p in unet.parameters())
    assert residency.token_of(unet) is None


def test_promoted_blocks_come_from_one_pinned_buffer_kept_across_runs():
    """resident_blocks (the pool's promoted blocks): exact GPU copies for the scope, host data back after (as
    views of the pinned buffers, the pageable originals freed), and the second run reuses the first run's
    pinned buffer instead of copying from pageable memory again."""
    from sd_accel.engine.memory.promoted_blocks import resident_blocks

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_blocks = torch.nn.ModuleList([torch.nn.Conv2d(4, 8, 3), torch.nn.Linear(8, 8)])
            self.out = torch.nn.Linear(8, 2)

    net = Net().half()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    hosts = {k: v.data_ptr() for k, v in net.state_dict().items()}
    cache, dev = {}, torch.device("cuda", torch.cuda.current_device())
    flats = []
    for _ in range(2):
        with resident_blocks(dev, net, ["input_blocks.0", "input_blocks.1"], cache) as n:
            assert n == 4
            assert all(p.is_cuda for p in net.input_blocks.parameters()) and not net.out.weight.is_cuda
            for k, v in net.state_dict().items():
                assert torch.equal(v.cpu(), before[k]), k
            flats.append(sorted(id(f) for f in cache.values()))
            assert all(f.is_pinned() for f in cache.values()) and len(cache) == 2
        # the promoted tensors' host data now live in the pinned buffers (not beside them); `out` untouched
        spans = [(f.data_ptr(), f.data_ptr() + f.numel()) for f in cache.values()]
        for k, v in net.state_dict().items():
            if k.startswith("out."):
                assert v.data_ptr() == hosts[k], k
            else:
                assert v.is_pinned() and any(lo <= v.data_ptr() < hi for lo, hi in spans), k
    assert flats[0] == flats[1]          # built once, reused
