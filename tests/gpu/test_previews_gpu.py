"""GPU only: live previews through a real ComfyUI server on the GPU (`--preview-method latent2rgb`), read from its
websocket as the browser reads them. The Accelerated KSampler delivers its previews one step late
(hosts/comfyui/previews.py); here, with CUDA graphs (the first prompt captures, the second replays) and without,
each step still sends its `progress` message and one preview image, in order, every image the one stock's
KSampler shows for that step (same seed), and all of them inside the sampler node, before the next node starts.
"""
import io
import os
import sys
import tempfile

import numpy as np
from PIL import Image

from test_graphs_gpu import COMFY, REPO, WORK, comfy_env  # noqa: F401  (builds WORK/checkpoints/gpu_small)

sys.path.insert(0, os.path.join(REPO, "dev"))
import comfy_server  # noqa: E402
import comfy_ws  # noqa: E402

SIZE, STEPS, SEED, SAMPLER = 256, 6, 21, "3"
TXT2IMG = os.path.join(REPO, "workflows", "sd15_txt2img_accelerated.api.json")


def _graph(sampler, prefix, seed, **accel):
    wf = comfy_server.load_api_workflow(TXT2IMG, **{
        "4": {"ckpt_name": "gpu_small.safetensors"}, "5": {"width": SIZE, "height": SIZE, "batch_size": 1},
        "9": {"filename_prefix": prefix}})
    wf[SAMPLER]["class_type"] = sampler
    wf[SAMPLER]["inputs"].update(seed=seed, steps=STEPS)
    if sampler == "KSampler":
        for k in ("fused_kernels", "cuda_graph", "channels_last"):
            wf[SAMPLER]["inputs"].pop(k)
    wf[SAMPLER]["inputs"].update(accel)
    return wf


def _run(srv, ev, wf):
    start = ev.mark()
    pid = srv.queue(wf)
    ev.wait_done(pid, start, timeout=300)
    msgs = ev.of_prompt(pid, start)
    assert all(m.type != "execution_error" for m in msgs), [m.data for m in msgs if m.type == "execution_error"]
    return msgs


def _sampler_steps(msgs):
    """(progress (value, max) list, preview images) between the sampler's `executing` and the next node's;
    asserts every preview of the prompt is in there, each after its step's progress message."""
    begin = next(i for i, m in enumerate(msgs) if m.type == "executing" and m.data.get("node") == SAMPLER)
    end = next(i for i in range(begin + 1, len(msgs)) if msgs[i].type == "executing")
    win = msgs[begin + 1:end]
    frames = [m for m in win if m.binary]
    assert sum(m.binary for m in msgs) == len(frames), "previews outside the sampler node"
    assert [m.type for m in frames] == [comfy_ws.PREVIEW_IMAGE] * len(frames)
    kinds = ["p" if m.type == "progress" else "i" for m in win if m.type == "progress" or m.binary]
    assert kinds == ["p", "i"] * STEPS, kinds
    progress = [(m.data["value"], m.data["max"]) for m in win if m.type == "progress"]
    images = [np.asarray(Image.open(io.BytesIO(m.data[4:])).convert("RGB")).astype(np.float64) for m in frames]
    return progress, images


def _report(msgs):
    return next(m for m in msgs if m.type == "executed" and m.data["node"] == SAMPLER).data["output"][
        "sdaccel_report"][0]


def test_previews_every_step_with_and_without_graphs_as_stock(comfy_env):  # noqa: F811
    work = tempfile.mkdtemp(prefix="sdaccel_gpu_previews_")
    srv = comfy_server.ComfyServer(COMFY, sys.executable, work, WORK, cpu=False,
                                   extra_args=comfy_server.empty_frontend(work) + ["--preview-method", "latent2rgb"])
    srv.start()
    try:
        with srv.events() as ev:
            # a new seed or new inputs per prompt: ComfyUI would serve an unchanged sampler node from its cache
            stock = {seed: _sampler_steps(_run(srv, ev, _graph("KSampler", "pv_stock", seed)))
                     for seed in (SEED, SEED + 1)}
            runs = {}
            for name, seed, accel in (("graphs_capture", SEED, {}), ("graphs_replay", SEED + 1, {}),
                                      ("eager", SEED + 1, {"cuda_graph": False})):
                msgs = _run(srv, ev, _graph("SDAccelKSampler", "pv_" + name, seed, **accel))
                runs[name] = (seed, _sampler_steps(msgs), _report(msgs))
        assert srv.proc.poll() is None, srv.log_tail()
    finally:
        srv.stop()
    want = [(i + 1, STEPS) for i in range(STEPS)]
    for progress, images in stock.values():
        assert progress == want
        assert np.abs(images[0] - images[-1]).mean() > 10, "the previews move from step to step"
    for name, (seed, (progress, images), report) in runs.items():
        assert progress == want, (name, progress)
        for step, (a, b) in enumerate(zip(stock[seed][1], images)):
            assert np.abs(a - b).mean() < 3.0, (name, step, np.abs(a - b).mean())
    assert runs["graphs_replay"][2]["graphs"]["replays"] > 0, runs["graphs_replay"][2]
    assert not (runs["eager"][2].get("graphs") or {}).get("replays"), runs["eager"][2]
