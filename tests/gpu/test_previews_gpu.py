"""GPU only: live previews through a real ComfyUI server on the GPU (`--preview-method latent2rgb`), read from its
websocket as the browser reads them. The Accelerated KSampler delivers its previews a few steps late
(hosts/comfyui/previews.py); here, with CUDA graphs (the first prompt captures, the second replays) and without,
each step still sends its `progress` message (the values stock's KSampler sends) and one preview image, in
order, all inside the sampler node, before the next node starts, and each image shows that step's latent.

The reference image of a step is drawn in this process from the same checkpoint, text, seed and sampler, its
latent read synchronously, by ComfyUI's own previewer, and sized and encoded as the server sends it. Not stock's
preview from the server: the current ComfyUI copies the latent with non_blocking=True and draws from the host
buffer without waiting for the copy, so on a busy GPU its image can be an earlier step's (printed, not asserted).
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
TOL = 3.0   # mean abs difference allowed between two JPEGs of one step's latent (fp16 noise, JPEG)
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
    assert all(m.data["node"] == SAMPLER for m in win if m.type == "progress"), "progress of another node"
    progress = [(m.data["value"], m.data["max"]) for m in win if m.type == "progress"]
    images = [np.asarray(Image.open(io.BytesIO(m.data[4:])).convert("RGB")).astype(np.float64) for m in frames]
    return progress, images


def _reference_previews(env, seed):
    """Each step's preview as the server would send it, from latents read synchronously in this process."""
    import torch
    import comfy.cli_args
    import comfy.sample
    import latent_preview
    from PIL import ImageOps
    wf = _graph("KSampler", "ref", seed)
    with torch.inference_mode():
        pos = env.nodes.CLIPTextEncode().encode(env.clip, wf["6"]["inputs"]["text"])[0]
        neg = env.nodes.CLIPTextEncode().encode(env.clip, wf["7"]["inputs"]["text"])[0]
        latent = env.nodes.EmptyLatentImage().generate(SIZE, SIZE, 1)[0]["samples"]
        noise = comfy.sample.prepare_noise(latent, seed)
        x0s = []
        comfy.sample.sample(env.model, noise, STEPS, 7.0, "euler", "normal", pos, neg, latent, seed=seed,
                            callback=lambda step, x0, x, total: x0s.append(x0[:1].float().cpu()))
    method = comfy.cli_args.args.preview_method
    comfy.cli_args.args.preview_method = comfy.cli_args.LatentPreviewMethod.Latent2RGB
    try:
        previewer = latent_preview.get_previewer("cpu", env.model.model.latent_format)
    finally:
        comfy.cli_args.args.preview_method = method
    out = []
    for x0 in x0s:
        image = ImageOps.contain(previewer.decode_latent_to_preview(x0), (512, 512), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=95)
        out.append(np.asarray(Image.open(buf).convert("RGB")).astype(np.float64))
    return out


def _report(msgs):
    return next(m for m in msgs if m.type == "executed" and m.data["node"] == SAMPLER).data["output"][
        "sdaccel_report"][0]


def test_previews_every_step_with_and_without_graphs_each_of_its_own_step(comfy_env):  # noqa: F811
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
    references = {seed: _reference_previews(comfy_env, seed) for seed in stock}
    for seed, (progress, images) in stock.items():
        assert progress == want
        assert np.abs(references[seed][0] - references[seed][-1]).mean() > 2 * TOL, "the previews move step to step"
        print("stock's server previews against the reference, seed %d, mean abs per step:" % seed,
              [round(float(np.abs(a - b).mean()), 2) for a, b in zip(references[seed], images)])
    for name, (seed, (progress, images), report) in runs.items():
        assert progress == want, (name, progress)
        late = "live previews: %d delivered a few steps late, without a GPU wait per step (" % STEPS
        assert any(n.startswith(late) for n in report["notes"]), (name, report["notes"])
        for step, (a, b) in enumerate(zip(references[seed], images)):
            assert np.abs(a - b).mean() < TOL, (name, step, np.abs(a - b).mean())
    assert runs["graphs_replay"][2]["graphs"]["replays"] > 0, runs["graphs_replay"][2]
    assert not (runs["eager"][2].get("graphs") or {}).get("replays"), runs["eager"][2]
