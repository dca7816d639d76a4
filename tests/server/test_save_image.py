"""Save Image (SD Accel) through the real ComfyUI server: for the same images it writes what Save Image writes (the
same pixels, names numbered the same way, the prompt and workflow embedded as the same text chunks) at the PNG
compression level its input says; a batch comes back whole and in order; a prefix outside the output folder fails
the prompt with ComfyUI's own message and the server goes on."""
import json
import zlib

import numpy as np
from PIL import Image

from workflow_util import txt2img

WORKFLOW = {"nodes": [{"id": 9, "type": "SaveImage"}], "links": [], "note": "what the frontend sends"}


def _post(comfy, wf):
    """As the frontend posts: the prompt, and the workflow in extra_pnginfo."""
    return comfy.run(wf, extra_data={"extra_pnginfo": {"workflow": WORKFLOW}})


def _graph(models, saver, prefix, batch=3, **inputs):
    wf = txt2img(models["sd15"], sampler="KSampler", seed=11, prefix=prefix)
    wf["5"]["inputs"]["batch_size"] = batch
    wf["9"]["class_type"] = saver
    wf["9"]["inputs"].update(inputs)
    return wf


def _zlib_header(png):
    """(FLEVEL, whether the first deflate block is stored) of a PNG's zlib stream. RFC 1950's FLEVEL: 0 for
    levels 0 and 1, 1 for 2-5, 2 for 6, 3 for 7-9; level 0 writes stored blocks only."""
    at = png.index(b"IDAT") + 4
    cmf, flg = png[at], png[at + 1]
    assert cmf & 0x0F == 8 and (cmf * 256 + flg) % 31 == 0, "not a zlib header"
    return flg >> 6, (png[at + 2] >> 1) & 0b11 == 0


def _level(path):
    with open(path, "rb") as f:
        return _zlib_header(f.read())


def _chunks(path):
    """The PNG's text chunks, decoded."""
    img = Image.open(path)
    img.load()
    return {k: json.loads(v) for k, v in img.text.items()}


def test_same_files_as_save_image_at_the_level_asked_for(comfy, models):
    stock_wf = _graph(models, "SaveImage", "save_stock")
    ours_wf = _graph(models, "SDAccelSaveImage", "save_ours", compress_level=1)
    stock = comfy.output_images(_post(comfy, stock_wf))
    ours = comfy.output_images(_post(comfy, ours_wf))
    assert len(stock) == len(ours) == 3
    for s, o in zip(stock, ours):
        assert np.array_equal(np.asarray(Image.open(s)), np.asarray(Image.open(o)))
        assert o.replace("save_ours", "save_stock").endswith(s.rsplit("/", 1)[1])   # the same numbering
        cs, co = _chunks(s), _chunks(o)
        assert cs["workflow"] == co["workflow"] == WORKFLOW
        assert cs["prompt"] == stock_wf and co["prompt"] == ours_wf
        assert _level(s)[0] == 1 and _level(o)[0] == 0   # Save Image's level 4, ours 1

    again = comfy.output_images(_post(comfy, _graph(models, "SDAccelSaveImage", "save_ours", compress_level=9)))
    assert [p.rsplit("_", 2)[1] for p in again] == ["00004", "00005", "00006"]   # numbering goes on
    assert all(_level(p)[0] == 3 for p in again)
    stored = comfy.output_images(_post(comfy, _graph(models, "SDAccelSaveImage", "save_l0", compress_level=0)))
    for s, o in zip(stock, stored):
        assert _level(o) == (0, True)
        assert np.array_equal(np.asarray(Image.open(s)), np.asarray(Image.open(o)))


def test_a_prefix_outside_the_output_folder_fails_the_prompt_and_the_server_goes_on(comfy, models):
    bad = comfy.run(_graph(models, "SDAccelSaveImage", "../outside", batch=1), expect_success=False)
    assert bad["status"]["status_str"] == "error"
    assert "outside the output folder" in json.dumps(bad["status"])
    good = comfy.output_images(comfy.run(_graph(models, "SDAccelSaveImage", "save_after_bad", batch=1)))
    assert len(good) == 1


def test_the_header_reader_against_zlib():
    """PIL's PNG encoder writes IDAT through zlib at the level it is given."""
    raw = bytes(range(256)) * 64
    assert [_zlib_header(b"IDAT" + zlib.compress(raw, lv)) for lv in (0, 1, 4, 6, 9)] == [
        (0, True), (0, False), (1, False), (2, False), (3, False)]
