"""Live previews and progress through the real server (`--preview-method latent2rgb`), read from its websocket as
the browser reads them: the Accelerated KSampler delivers one preview image per step, showing that step's
denoised latent, and the same `progress` value/max per step as the stock KSampler with the same seed. Current
ComfyUI also sends previews with metadata (node and prompt id) to a client that says it supports them; that
path is checked the same way. The server defers on its CPU as on a GPU (SDACCEL_DEFERRED_PREVIEWS=always, see
conftest.py): these are the Accelerated KSampler's previews delivered a few steps late, through ComfyUI's own hook."""
import io
import json
import urllib.error
import uuid

import numpy as np
import pytest
from PIL import Image

import comfy_ws
from workflow_util import txt2img

STEPS, SEED, SAMPLER = 4, 17, "3"


def _events_of(ev, srv, wf, client_id=None):
    start = ev.mark()
    pid = srv.queue(wf, client_id=client_id)
    ev.wait_done(pid, start, timeout=300)
    msgs = ev.of_prompt(pid, start)
    assert msgs and msgs[-1].type == "executing", msgs[-5:]
    return pid, msgs


def _sampler_window(msgs):
    """The messages between the sampler node's `executing` and the next node's."""
    begin = next(i for i, m in enumerate(msgs) if m.type == "executing" and m.data.get("node") == SAMPLER)
    end = next(i for i in range(begin + 1, len(msgs)) if msgs[i].type == "executing")
    return msgs[begin + 1:end]


def _progress(msgs):
    return [(m.data["value"], m.data["max"], m.data["node"]) for m in msgs if m.type == "progress"]


def _jpeg(payload):
    return np.asarray(Image.open(io.BytesIO(payload)).convert("RGB")).astype(np.float64)


def _run(ev, srv, ckpt, sampler, seed, client_id=None, prefix="pv"):
    wf = txt2img(ckpt, sampler, seed=seed, steps=STEPS, prefix=prefix)
    pid, msgs = _events_of(ev, srv, wf, client_id)
    assert all(m.type != "execution_error" for m in msgs), [m for m in msgs if m.type == "execution_error"]
    return pid, msgs


def _assert_same_previews(stock, ours):
    """Each step's preview of ours shows the same denoised latent as stock's at that step (fp noise only), and the
    previews move from step to step, so a stale or repeated image would not pass."""
    assert len(ours) == len(stock) == STEPS
    for step, (a, b) in enumerate(zip(stock, ours)):
        assert a.shape == b.shape, (step, a.shape, b.shape)
        assert np.abs(a - b).mean() < 3.0, (step, np.abs(a - b).mean())
    assert np.abs(stock[0] - stock[-1]).mean() > 10 * max(np.abs(a - b).mean() for a, b in zip(stock, ours)) + 1


def test_a_preview_and_a_progress_message_per_step_as_with_ksampler(comfy_preview, models):
    srv = comfy_preview
    with srv.events() as ev:
        _, stock_msgs = _run(ev, srv, models["sd15"], "KSampler", SEED, prefix="pv_stock")
        _, ours_msgs = _run(ev, srv, models["sd15"], "SDAccelKSampler", SEED, prefix="pv_ours")
    stock_win, ours_win = _sampler_window(stock_msgs), _sampler_window(ours_msgs)
    want = [(i + 1, STEPS, SAMPLER) for i in range(STEPS)]
    assert _progress(stock_win) == want
    assert _progress(ours_win) == want
    previews = {}
    for name, win, msgs in (("stock", stock_win, stock_msgs), ("ours", ours_win, ours_msgs)):
        frames = [m for m in win if m.binary]
        assert [m.type for m in frames] == [comfy_ws.PREVIEW_IMAGE] * STEPS, (name, frames)
        assert sum(m.binary for m in msgs) == STEPS, "%s: previews outside the sampler node" % name
        # a preview follows its step's progress message: progress, preview, progress, preview, ...
        kinds = ["p" if m.type == "progress" else "i" for m in win if m.type == "progress" or m.binary]
        assert kinds == ["p", "i"] * STEPS, (name, kinds)
        # the payload: 4 bytes of image type (1 = JPEG), then the image
        assert all(m.data[:4] == b"\x00\x00\x00\x01" for m in frames)
        previews[name] = [_jpeg(m.data[4:]) for m in frames]
    _assert_same_previews(previews["stock"], previews["ours"])
    report = next(m for m in ours_msgs if m.type == "executed" and m.data["node"] == SAMPLER).data["output"]
    report = report["sdaccel_report"][0]
    # every step went through our step wrapper (on this CPU: its eager path; graphs need CUDA)
    assert report["steps"] == STEPS and report["graphs"]["eager"] == STEPS, report
    late = "live previews: %d delivered a few steps late, without a GPU wait per step (" % STEPS
    assert any(n.startswith(late) for n in report["notes"]), report["notes"]


def test_previews_with_metadata_for_a_client_that_supports_them(comfy_preview, models):
    srv = comfy_preview
    features = _features(srv)
    if features is None:
        pytest.skip("this ComfyUI (2024) has no preview metadata: no /features route and no "
                    "PREVIEW_IMAGE_WITH_METADATA event in its server.py, only PREVIEW_IMAGE")
    assert features.get("supports_preview_metadata") is True
    client = "pv-meta-" + uuid.uuid4().hex[:8]
    with srv.events(client_id=client, feature_flags={"supports_preview_metadata": True}) as ev:
        ev.wait_for(lambda m: m.type == "feature_flags", timeout=30)   # the server's answer to ours
        got = {}
        for sampler in ("KSampler", "SDAccelKSampler"):
            # another seed than the test above: ComfyUI would serve that sampler's output from its cache
            pid, msgs = _run(ev, srv, models["sd15"], sampler, SEED + 1, client_id=client, prefix="pvm")
            frames = [m for m in _sampler_window(msgs) if m.binary]
            assert sum(m.binary for m in msgs) == len(frames) == STEPS, (sampler, frames)
            assert {m.type for m in frames} == {comfy_ws.PREVIEW_IMAGE_WITH_METADATA}, (sampler, frames)
            images = []
            for m in frames:
                n = int.from_bytes(m.data[:4], "big")
                meta = json.loads(m.data[4:4 + n])
                assert meta["node_id"] == SAMPLER and meta["prompt_id"] == pid, meta
                assert meta["image_type"] == "image/jpeg", meta
                images.append(_jpeg(m.data[4 + n:]))
            states = [(s["value"], s["max"], s["state"]) for s in (
                m.data["nodes"][SAMPLER] for m in msgs if m.type == "progress_state" and SAMPLER in m.data["nodes"])]
            # progress_state repeats every node's state on each update of any node: its changes are the steps
            got[sampler] = (images, [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]])
    _assert_same_previews(got["KSampler"][0], got["SDAccelKSampler"][0])
    assert got["SDAccelKSampler"][1] == got["KSampler"][1], "progress_state per step as stock's"
    assert [s[0] for s in got["KSampler"][1] if s[2] == "running"][-STEPS:] == list(range(1, STEPS + 1))
    assert got["KSampler"][1][-1] == (STEPS, STEPS, "finished"), got["KSampler"][1]


def _features(srv):
    try:
        return srv.get("/features", timeout=10)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise
