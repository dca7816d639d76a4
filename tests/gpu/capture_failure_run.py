"""Run by tests/gpu/test_patch_nodes_gpu.py in a process of its own (the allocator is fixed at CUDA start-up,
and an abort must not take the test session down): the Accelerated KSampler with a patch whose capture fails,
then in the same process what must still work as if SD Accel were not installed. Prints one `RESULT {json}`
line; the test asserts on it and on the exit status.

    python tests/gpu/capture_failure_run.py <ComfyUI dir> <work dir holding checkpoints/gpu_small.safetensors>

The failing patch is dev/patch_nodes.py's `add_capture_breaking_patch`: a device sync only while a capture is
under way (the identity for the values, so stock and an eager accelerated run give the same image).
"""
import json
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZE, NEW_SIZE, STEPS, SEED = 256, 320, 6, 5


def boot(comfy_dir, work):
    """ComfyUI imported as main.py does (its cudaMallocAsync allocator), the checkpoint loaded, prompts encoded."""
    sys.path.insert(0, comfy_dir)
    sys.path.insert(0, os.path.join(REPO, "dev"))
    argv, sys.argv = sys.argv, [sys.argv[0]]
    import comfy.options
    comfy.options.enable_args_parsing()
    import cuda_malloc  # noqa: F401
    sys.argv = argv
    import torch
    import folder_paths
    import comfy.utils
    import nodes
    comfy.utils.set_progress_bar_enabled(False)
    folder_paths.add_model_folder_path("checkpoints", os.path.join(work, "checkpoints"), is_default=True)
    pkg = types.ModuleType("sd_accel")
    pkg.__path__ = [REPO]
    sys.modules["sd_accel"] = pkg
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    with torch.inference_mode():
        model, clip = nodes.CheckpointLoaderSimple().load_checkpoint("gpu_small.safetensors")[:2]
        pos = nodes.CLIPTextEncode().encode(clip, "a cat")[0]
        neg = nodes.CLIPTextEncode().encode(clip, "")[0]
    return types.SimpleNamespace(torch=torch, nodes=nodes, model=model, pos=pos, neg=neg, ours=SDAccelKSampler())


def sample(env, model, ours, size=SIZE):
    torch, nodes = env.torch, env.nodes
    with torch.inference_mode():
        lat = nodes.EmptyLatentImage().generate(size, size, 1)[0]
        if ours:
            res = env.ours.sample(model, SEED, STEPS, 7.0, "euler", "normal", env.pos, env.neg, lat)
            return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]
        out = nodes.KSampler().sample(model, SEED, STEPS, 7.0, "euler", "normal", env.pos, env.neg, lat)[0]
        return out["samples"].float(), None


def rel(a, b):
    return float((a - b).norm() / b.norm())


def torch_graph_works(torch):
    """A plain torch CUDA graph, outside SD Accel: captures, replays and reads the new input."""
    x = torch.ones(64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = x * 2
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        y = x * 2
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    return bool((y == 6.0).all())


# What the layout recorder saw, one list per sampling run. A module global, not a closure cell: a patch's closure
# is part of its graph key (engine/graphs/tokens.py), so a list growing in it would make every call a new key and
# the failing patch would never reach its capture.
LAYOUT_RUNS = [[]]


def record_conv_layout(torch, model):
    """Adds an input-block patch to `model` (a clone) that records in LAYOUT_RUNS[-1], on each eager call, whether
    the UNet's 3x3 conv weights are channels_last (the caller appends a list before each run)."""
    conv = next(m for m in model.model.diffusion_model.modules()
                if isinstance(m, torch.nn.Conv2d) and m.weight.shape[-1] > 1)

    def conv_layout_seen(h, transformer_options):
        if not torch.cuda.is_current_stream_capturing():
            LAYOUT_RUNS[-1].append(not conv.weight.is_contiguous())
        return h
    model.set_model_input_block_patch(conv_layout_seen)
    return LAYOUT_RUNS


def cuda_rng_works(torch):
    """The CUDA generator is not left in capture state and reproduces a seeded draw."""
    draws = []
    for _ in range(2):
        torch.cuda.manual_seed(123)
        draws.append(torch.randn(1024, device="cuda"))
    return bool(torch.equal(draws[0], draws[1]))


def main(comfy_dir, work):
    env = boot(os.path.abspath(comfy_dir), work)
    import patch_nodes                       # dev/, on the path once booted
    torch = env.torch
    stock_plain, _ = sample(env, env.model, ours=False)
    tome = patch_nodes.apply_case(env.model, [("TomePatchModel", {"ratio": 0.3})])
    stock_tome, _ = sample(env, tome, ours=False)
    failing = patch_nodes.add_capture_breaking_patch(env.model)
    layouts = record_conv_layout(torch, failing)
    failing_ref, _ = sample(env, failing, ours=False)
    failing_runs = []
    for _ in range(2):
        layouts.append([])
        failing_runs.append(sample(env, failing, ours=True))
    result = {"failing_rel": [rel(out, failing_ref) for out, _ in failing_runs],
              "failing_layouts": layouts[1:],
              "failing_reports": [report for _, report in failing_runs],
              "failing_names": sorted(patch_nodes.patch_names(env.model, failing,
                                                                    [patch_nodes.CAPTURE_BREAKING_NAME]))}
    result["stock_plain_rel"] = rel(sample(env, env.model, ours=False)[0], stock_plain)
    result["stock_tome_rel"] = rel(sample(env, tome, ours=False)[0], stock_tome)
    result["cuda_rng_ok"] = cuda_rng_works(torch)
    result["torch_graph_ok"] = torch_graph_works(torch)
    new_ref, _ = sample(env, env.model, ours=False, size=NEW_SIZE)
    new_out, new_report = sample(env, env.model, ours=True, size=NEW_SIZE)
    result["new_size"] = (rel(new_out, new_ref), new_report)
    freeu = patch_nodes.apply_case(env.model, [patch_nodes.FREEU_V2])
    freeu_ref, _ = sample(env, freeu, ours=False)
    freeu_out, freeu_report = sample(env, freeu, ours=True)
    result["other_patch"] = (rel(freeu_out, freeu_ref), freeu_report)
    torch.cuda.synchronize()
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
