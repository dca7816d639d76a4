"""Every shipped API workflow (workflows/*.api.json) runs through the real server at test size.

Generic overrides only, so a new workflow is covered without touching this file: width/height -> 64,
steps -> 2, ckpt_name/control_net_name/lora_name -> the fixture files, a LoadImage `image` -> a small
test photo. Fused kernels are off (they run under the Triton interpreter here, which is slow) except in
the one dedicated test that runs the richest workflow with its shipped settings.
"""
import glob
import json
import os
import sys
import urllib.error
import uuid
import zlib

import numpy as np
import pytest
from PIL import Image

from workflow_util import REPO, WORKFLOWS, image

API_FILES = sorted(glob.glob(os.path.join(WORKFLOWS, "*.api.json")))
MODEL_INPUTS = {"ckpt_name": "sd15", "control_net_name": "cn15", "lora_name": "lora15"}


def write_photo(input_dir, name, mark=None, size=128, flip=False):
    """skimage's astronaut at `size` px as a PNG in the server's input folder. `mark` paints a small
    square whose position/colour come from the string, so the pixels are new to the disk cache."""
    from skimage import data
    img = Image.fromarray(data.astronaut()).resize((size, size), Image.BILINEAR)
    arr = np.array(img)
    if flip:
        arr = arr[:, ::-1].copy()
    if mark is not None:
        rng = np.random.default_rng(zlib.crc32(mark.encode()))
        y, x = rng.integers(0, size - 8, 2)
        arr[y:y + 6, x:x + 6] = rng.integers(0, 256, 3)
    Image.fromarray(arr).save(os.path.join(input_dir, name))
    return name


def load(path):
    with open(path) as f:
        return json.load(f)


def at_test_size(wf, models, photo, steps=2, fused_kernels=False, prefix=None):
    """The generic test-size overrides, in place; returns `wf`."""
    prefix = prefix or "wf_" + uuid.uuid4().hex[:8]
    for node in wf.values():
        ins = node["inputs"]
        for k, v in list(ins.items()):
            if isinstance(v, list):
                continue   # a link
            if k in ("width", "height"):
                ins[k] = 64
            elif k == "steps":
                ins[k] = steps
            elif k in MODEL_INPUTS:
                ins[k] = models[MODEL_INPUTS[k]]
            elif k == "image" and node["class_type"] == "LoadImage":
                ins[k] = photo
            elif k == "fused_kernels" and fused_kernels is not None:
                ins[k] = fused_kernels
            elif k == "filename_prefix":
                ins[k] = prefix
    return wf


def sdaccel_nodes(wf):
    return [n["class_type"] for n in wf.values() if n["class_type"].startswith("SDAccel")]


@pytest.fixture(scope="module")
def photo(comfy):
    return write_photo(comfy.input_dir, "sdaccel_test_photo.png")


def test_workflows_are_found_and_documented():
    assert len(API_FILES) >= 2, API_FILES
    for path in API_FILES:
        assert all("class_type" in node for node in load(path).values()), "only nodes in an API file: %s" % path
        ui = path.replace(".api.json", ".json")
        assert os.path.exists(ui), "no UI twin (dev/workflow_ui.py) for %s" % path
        with open(ui) as f:
            twin = json.load(f)
        meta = twin["extra"]["sd_accel"]
        assert meta["title"] and meta["description"], ui
        types_ui = sorted(n["type"] for n in twin["nodes"])
        assert types_ui == sorted(n["class_type"] for n in load(path).values()), ui


@pytest.mark.parametrize("path", API_FILES, ids=[os.path.basename(p) for p in API_FILES])
def test_ui_twin_is_fresh(comfy, path):
    """The UI file loads as what dev/workflow_ui.py makes of the API file against this server's
    /object_info. The frontend gives widgets missing at the end of a saved node their defaults, so a twin
    saved before an optional input was added is still fine as long as the API file leaves it default."""
    sys.path.insert(0, os.path.join(REPO, "dev"))
    import workflow_ui
    info = comfy.object_info()
    with open(path) as f:
        api = json.load(f)
    with open(path.replace(".api.json", ".json")) as f:
        have = json.load(f)
    meta = have["extra"]["sd_accel"]
    want = workflow_ui.api_to_ui(api, info, meta)
    defaults = workflow_ui.api_to_ui(
        {k: dict(v, inputs={n: x for n, x in v["inputs"].items() if isinstance(x, list)
                            or n not in info[v["class_type"]]["input"].get("optional", {})})
         for k, v in api.items()}, info, meta)
    assert have["links"] == want["links"]
    for h, w, d in zip(have["nodes"], want["nodes"], defaults["nodes"]):
        assert h["type"] == w["type"]
        loaded = h["widgets_values"] + d["widgets_values"][len(h["widgets_values"]):]
        assert loaded == w["widgets_values"], (
            "%s: regenerate the UI twin: python dev/workflow_ui.py --server <url> %s" % (h["type"], path))


@pytest.mark.parametrize("path", API_FILES, ids=[os.path.basename(p) for p in API_FILES])
def test_workflow_runs_at_test_size(comfy, models, photo, path):
    wf = at_test_size(load(path), models, photo)
    entry = comfy.run(wf)
    paths = comfy.output_images(entry)
    assert paths, entry.get("outputs")
    img = image(paths[0])
    assert img.shape == (64, 64, 3) and np.isfinite(img).all()
    for node_id, node in wf.items():
        if node["class_type"] == "SDAccelKSampler":
            report = entry["outputs"][node_id]["sdaccel_report"][0]
            assert report["steps"] == 2 and report["fell_back"]["fused_kernels"] == "off"


def test_richest_workflow_with_its_shipped_accelerations(comfy, models, photo):
    """Fused kernels as shipped (on), on the workflow with the most SD Accel nodes."""
    path = max(API_FILES, key=lambda p: (len(sdaccel_nodes(load(p))), p))
    wf = at_test_size(load(path), models, photo, steps=1, fused_kernels=None)
    entry = comfy.run(wf)
    assert comfy.output_images(entry)
    for node_id, node in wf.items():
        if node["class_type"] == "SDAccelKSampler":
            assert node["inputs"]["fused_kernels"] is True
            report = entry["outputs"][node_id]["sdaccel_report"][0]
            ran = " ".join(report["ran"])
            assert "group_norm_silu x" in ran and "geglu x" in ran, report


SHIPPED_FOLDERS = {"ckpt_name": "checkpoints", "control_net_name": "controlnet"}


def _provide_shipped_names(comfy):
    """The files the shipped workflows name, so that ComfyUI's validation (every name against its lists) can pass:
    model files that fail to load, so the full-size run the accepted prompt starts ends at its first loader (on
    this CPU a 512-pixel run would take hours), and the photo LoadImage names, in the server's input folder."""
    import shutil
    for path in API_FILES:
        for node in load(path).values():
            for k, v in node["inputs"].items():
                if k in SHIPPED_FOLDERS:
                    stand_in = os.path.join(comfy.models_dir, SHIPPED_FOLDERS[k], v)
                    if not os.path.exists(stand_in):
                        with open(stand_in, "wb") as f:
                            f.write(b"not a model: stands for the user's file in test_workflows.py")
                elif k == "image" and node["class_type"] == "LoadImage":
                    shutil.copy(os.path.join(comfy.input_dir, write_photo(comfy.input_dir, "tmp_photo.png")),
                                os.path.join(comfy.input_dir, v))


@pytest.mark.parametrize("path", API_FILES, ids=[os.path.basename(p) for p in API_FILES])
def test_the_shipped_file_is_accepted_byte_for_byte(comfy, path):
    """What the README tells users: POST the file's contents as the prompt. ComfyUI validates the whole prompt
    before queueing it (a top-level key that is not a node is refused); the run then stops at the stand-in
    model file, and the server stays up."""
    import urllib.request
    _provide_shipped_names(comfy)
    with open(path, "rb") as f:
        body = b'{"prompt": ' + f.read() + b', "client_id": "byte-for-byte"}'
    req = urllib.request.Request(comfy.url + "/prompt", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        pytest.fail("ComfyUI refused %s: %s" % (os.path.basename(path), e.read().decode()[:1500]))
    assert answer.get("prompt_id") and not answer.get("node_errors"), answer
    entry = comfy.wait(answer["prompt_id"], timeout=300)
    assert entry["status"]["status_str"] == "error", entry["status"]     # stopped at the stand-in model file
    assert comfy.object_info()["SDAccelKSampler"], "the server is up"
