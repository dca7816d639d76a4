"""Pose preprocessor: OpenPose renderer on fixed keypoints, DWPose-format ONNX pipeline on tiny models."""
import importlib.util
import os

import numpy as np
import pytest
import skimage.data
import torch

from sd_accel.engine import preprocess as pp
from sd_accel.engine.preprocess.condition_cache import ConditionCache
from sd_accel.engine.preprocess import pose, pose_render
from sd_accel.engine.preprocess.pose_render import (BODY_COLORS, BODY_LIMBS, HAND_BONES, Person,
                                                    hand_bone_color, limb_color, render)

PHOTO = skimage.data.astronaut()

# A stick figure on a 512x512 canvas, OpenPose order, every limb's midpoint clear of other parts.
BODY = np.array([
    (256, 100), (256, 150), (196, 150), (136, 200), (100, 260), (316, 150), (376, 200), (412, 260),
    (226, 300), (216, 390), (206, 480), (286, 300), (296, 390), (306, 480), (236, 80), (276, 80),
    (206, 90), (306, 90)], np.float64)


def _body(scores=None):
    s = np.ones(18) if scores is None else np.asarray(scores, np.float64)
    return np.concatenate([BODY, s[:, None]], 1)


# ------------------------------------------------------------------------------------- renderer
def test_body_limb_and_joint_colours_on_black():
    img = render(512, 512, [Person(body=_body())], scale=1.0)
    assert img.shape == (512, 512, 3) and img.dtype == np.uint8
    for i, (a, b) in enumerate(BODY_LIMBS):
        mx, my = ((BODY[a] + BODY[b]) / 2).astype(int)
        assert tuple(img[my, mx]) == limb_color(i), f"limb {i} ({a}-{b})"
        assert limb_color(i) == tuple(int(c * 0.6) for c in BODY_COLORS[i])
    for k in range(18):
        x, y = BODY[k].astype(int)
        assert tuple(img[y, x]) == BODY_COLORS[k], f"joint {k}"
    assert tuple(img[0, 0]) == (0, 0, 0) and tuple(img[511, 511]) == (0, 0, 0)
    lit = img.any(-1).mean()
    assert 0.01 < lit < 0.15
    colours = {tuple(c) for c in img.reshape(-1, 3)}
    assert colours == {(0, 0, 0)} | set(BODY_COLORS) | {limb_color(i) for i in range(17)}


def test_limb_width_is_about_eight_pixels_and_scales_with_the_canvas():
    img = render(512, 512, [Person(body=_body())], scale=1.0)
    col = img[:, 256 - 30]  # crosses the horizontal-ish limb 1-2 at x=226
    assert 7 <= int((col[140:160] == limb_color(0)).all(-1).sum()) <= 9
    big = render(1024, 1024, [Person(body=np.concatenate([BODY * 2, np.ones((18, 1))], 1))])  # auto scale 2
    colb = big[:, 2 * 226]
    assert 15 <= int((colb[280:320] == limb_color(0)).all(-1).sum()) <= 17


def test_low_score_keypoints_and_their_limbs_are_skipped():
    s = np.ones(18)
    s[4] = 0.1  # right wrist
    img = render(512, 512, [Person(body=_body(s))], scale=1.0)
    x, y = BODY[4].astype(int)
    assert tuple(img[y, x]) == (0, 0, 0)
    mx, my = ((BODY[3] + BODY[4]) / 2).astype(int)
    assert tuple(img[my, mx]) == (0, 0, 0)  # limb 3 (elbow-wrist) gone
    x, y = BODY[3].astype(int)
    assert tuple(img[y, x]) == BODY_COLORS[3]


def test_hand_and_face_drawing():
    wrist = np.array([100.0, 400.0])
    pts = [wrist]
    for f in range(5):  # five straight fingers fanning upwards, 4 bones each, 15 px apart
        ang = np.radians(-150 + 30 * f)
        d = np.array([np.cos(ang), np.sin(ang)])
        pts += [wrist + d * 25 * (j + 1) for j in range(4)]
    hand = np.concatenate([np.array(pts), np.ones((21, 1))], 1)
    face = np.array([[300.0 + 12 * i, 100.0, 1.0] for i in range(10)])
    img = render(512, 512, [Person(right_hand=hand, face=face)], scale=1.0)
    for i, (a, b) in enumerate(HAND_BONES):
        mx, my = ((hand[a, :2].astype(int) + hand[b, :2].astype(int)) / 2).astype(int)
        if a == 0:
            continue  # the five wrist bones meet in the wrist's disc
        assert tuple(img[my, mx]) == hand_bone_color(i), f"bone {i}"
    assert hand_bone_color(0) == (255, 0, 0) and len({hand_bone_color(i) for i in range(20)}) == 20
    for x, y, _ in hand:
        assert tuple(img[int(y), int(x)]) == pose_render.HAND_POINT_COLOR
    for x, y, _ in face:
        assert tuple(img[int(y), int(x)]) == (255, 255, 255)
    none = render(512, 512, [Person(body=_body(), right_hand=hand, face=face)], body=False, hands=False,
                  face=False)
    assert not none.any()


def test_coco_wholebody_to_openpose_mapping():
    kp = np.zeros((1, 133, 2))
    kp[0, :, 0] = np.arange(133)  # x = COCO index
    sc = np.ones((1, 133))
    (p,) = pose.to_people(kp, sc)
    assert list(p.body[:, 0]) == [0, 5.5, 6, 8, 10, 5, 7, 9, 12, 14, 16, 11, 13, 15, 2, 1, 4, 3]
    assert p.body[1, 2] == 1.0
    assert list(p.face[:68, 0]) == list(range(23, 91)) and list(p.face[68:, 0]) == [2, 1]
    assert list(p.left_hand[:, 0]) == list(range(91, 112))
    assert list(p.right_hand[:, 0]) == list(range(112, 133))
    sc[0, 6] = 0.2
    assert pose.to_people(kp, sc)[0].body[1, 2] == 0.0  # neck needs both shoulders


# -------------------------------------------------------------------------------- ONNX pipeline
ort = pytest.importorskip("onnxruntime")
from tiny_models import DEFAULT_BOXES, make_tiny_pose_models  # noqa: E402


@pytest.fixture(scope="module")
def pose_dir(tmp_path_factory):
    return make_tiny_pose_models(str(tmp_path_factory.mktemp("pose")))


def test_detector_boxes_are_mapped_back_to_the_image(pose_dir, tmp_path):
    pre = pose.PosePreprocessor(search_dirs=[pose_dir])
    boxes, kps, scores = pre.keypoints(PHOTO)
    ratio = 640 / 512
    np.testing.assert_allclose(boxes, np.array(DEFAULT_BOXES) / ratio, atol=1e-3)
    assert kps.shape == (1, 133, 2) and scores.shape == (1, 133)
    e2e = make_tiny_pose_models(str(tmp_path / "e2e"), boxes=((10, 20, 300, 400), (320, 50, 600, 600)),
                                end2end=True)
    b2, k2, _ = pose.PosePreprocessor(search_dirs=[e2e]).keypoints(PHOTO)
    np.testing.assert_allclose(b2, np.array([(10, 20, 300, 400), (320, 50, 600, 600)]) / ratio, atol=1e-3)
    assert k2.shape == (2, 133, 2)


def test_yolox_decode_and_nms():
    raw = np.zeros((8400, 85), np.float32)
    i = 80 * 80 + 40 * 40 + 10 * 20 + 5  # stride-32 anchor at grid (5, 10)
    raw[i, :6] = (0.5, 0.5, np.log(4), np.log(2), 0.9, 0.9)
    raw[i + 1, :6] = (0.0, 0.5, np.log(4), np.log(2), 0.8, 0.8)  # heavy overlap: suppressed
    boxes, scores = pose.decode_yolox(raw, 640, 640)
    np.testing.assert_allclose(boxes[i], [5.5 * 32 - 64, 10.5 * 32 - 32, 5.5 * 32 + 64, 10.5 * 32 + 32])
    assert pose.nms(boxes[[i, i + 1]], scores[[i, i + 1]], 0.45) == [0]


def test_crop_geometry():
    center, scale = pose.box_to_center_scale((100, 50, 200, 450), 288, 384)
    assert np.allclose(center, (150, 250))
    assert np.isclose(scale[0] / scale[1], 288 / 384) and np.isclose(scale[1], 400 * 1.25)
    m = pose.crop_matrix(center, scale, 288, 384)
    assert np.allclose(m @ [150, 250, 1], [144, 192])
    cv2 = pytest.importorskip("cv2")  # the torch warp (no-OpenCV path) agrees with cv2.warpAffine
    a = cv2.warpAffine(PHOTO, m, (288, 384), flags=cv2.INTER_LINEAR).astype(np.float32)
    orig = pose.cv2_module
    try:
        pose.cv2_module = lambda: None
        b = pose.warp_affine(PHOTO, m, 288, 384)
    finally:
        pose.cv2_module = orig
    assert np.abs(a - b).mean() < 1.0


def test_pose_map_on_a_photo(pose_dir):
    pre = pose.PosePreprocessor(search_dirs=[pose_dir])
    (img,) = pre.compute(PHOTO[None])
    assert img.shape == (512, 512, 3) and img.dtype == np.uint8
    lit = img.any(-1).mean()
    assert 0.01 < lit < 0.6  # something drawn, mostly black background
    palette = ({(0, 0, 0), (255, 255, 255), pose_render.HAND_POINT_COLOR} | set(BODY_COLORS)
               | {limb_color(i) for i in range(17)} | {hand_bone_color(i) for i in range(20)})
    assert {tuple(c) for c in img.reshape(-1, 3)} <= palette
    body_only = pose.PosePreprocessor(search_dirs=[pose_dir], include_hands=False, include_face=False)
    (b,) = body_only.compute(PHOTO[None])
    assert b.any() and not (b == (255, 255, 255)).all(-1).any()
    assert body_only.spec() != pre.spec()


def test_no_person_gives_a_black_map(tmp_path):
    d = make_tiny_pose_models(str(tmp_path), boxes=())
    (img,) = pose.PosePreprocessor(search_dirs=[d]).compute(PHOTO[None])
    assert img.shape == (512, 512, 3) and not img.any()


def test_cached_pose_run_is_identical_and_skips_onnx(pose_dir, tmp_path, monkeypatch):
    img = torch.from_numpy(PHOTO.astype(np.float32) / 255)[None]
    cache = ConditionCache(str(tmp_path))
    out1, r1 = pp.run(pose.PosePreprocessor(search_dirs=[pose_dir]), img, cache)
    monkeypatch.setattr(pose, "_session", lambda *a: pytest.fail("ONNX session used on a cache hit"))
    out2, r2 = pp.run(pose.PosePreprocessor(search_dirs=[pose_dir]), img, cache)
    assert (r1.misses, r2.hits) == (1, 1) and torch.equal(out1, out2)
    entry = torch.load(next(tmp_path.glob("*.pt")), weights_only=True)
    assert entry["map"].shape == (512, 512, 3) and entry["channels"] == 3


def test_aux_ckpts_layout_and_env(pose_dir, tmp_path, monkeypatch):
    ckpts = tmp_path / "ckpts"
    dw = ckpts / "yzd-v" / "DWPose"
    dw.mkdir(parents=True)
    for f in ("yolox_l.onnx", "dw-ll_ucoco_384.onnx"):
        os.symlink(os.path.join(pose_dir, f), dw / f)
    monkeypatch.setenv(pose.AUX_ENV, str(ckpts))
    pre = pose.PosePreprocessor()
    assert pre.detector_path == str(dw / "yolox_l.onnx")
    assert pre.pose_path == str(dw / "dw-ll_ucoco_384.onnx")
    assert pose.list_onnx_files(pose.pose_search_dirs()) == ["dw-ll_ucoco_384.onnx", "yolox_l.onnx"]


def test_missing_weights_message(tmp_path, monkeypatch):
    monkeypatch.delenv(pose.AUX_ENV, raising=False)
    (tmp_path / "yolox_l.onnx").write_bytes(b"x")
    with pytest.raises(pp.MissingWeightsError) as e:
        pose.PosePreprocessor(search_dirs=[str(tmp_path), str(tmp_path / "other")])
    msg = str(e.value)
    assert "dw-ll_ucoco_384.onnx" in msg and "yolox_l.onnx" not in msg.split("Put them")[0]
    assert str(tmp_path) in msg and "downloaded" in msg
    with pytest.raises(pp.MissingWeightsError) as e:
        pose.PosePreprocessor(search_dirs=[str(tmp_path / "empty")])
    assert "yolox_l.onnx" in str(e.value) and "dw-ll_ucoco_384.onnx" in str(e.value)


def test_missing_onnxruntime_is_reported_clearly(pose_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"onnxruntime.*not installed.*pip install onnxruntime"):
        pose.PosePreprocessor(search_dirs=[pose_dir])


def test_pipeline_without_opencv(pose_dir, monkeypatch):
    with_cv2 = pose.PosePreprocessor(search_dirs=[pose_dir])
    (ref,) = with_cv2.compute(PHOTO[None])
    assert with_cv2.spec()["implementation"] == "dwpose-onnx/cv2"
    monkeypatch.setattr(pose, "cv2_module", lambda: None)
    pre = pose.PosePreprocessor(search_dirs=[pose_dir])
    assert pre.spec()["implementation"] == "dwpose-onnx/torch" and "cv2" not in pre.spec()["libs"]
    boxes, _, _ = pre.keypoints(PHOTO)
    np.testing.assert_allclose(boxes, np.array(DEFAULT_BOXES) / 1.25, atol=1e-3)
    (img,) = pre.compute(PHOTO[None])
    assert img.shape == ref.shape and img.any()
