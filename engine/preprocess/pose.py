"""Whole-body pose maps with the DWPose ONNX files through onnxruntime, drawn OpenPose style.

Pipeline (our own thin implementation of the usual top-down recipe):
  1. letterbox the RGB frame into the detector input (top-left, grey 114 padding, no normalisation);
  2. YOLOX person detector (`yolox_l.onnx`): raw (1, N, 5 + classes) head decoded over the stride
     8/16/32 grids, or an mmdeploy end2end model (`dets`, `labels`); class 0 only, score > 0.3,
     greedy NMS at IoU 0.45;
  3. per person: box -> centre and 1.25x scale fixed to the pose input's aspect ratio -> affine crop
     (bilinear, black outside) -> ImageNet mean/std on 0-255 RGB;
  4. SimCC pose model (`dw-ll_ucoco_384.onnx`, 133 COCO-WholeBody keypoints): argmax over each
     axis, divided by the split ratio; score = the smaller of the two maxima;
  5. COCO order -> OpenPose 18 (neck = mid-shoulders), hands and face; drawn by `pose_render`.
Files come from local folders only; a missing file raises MissingWeightsError, never a download.
"""
from __future__ import annotations

import importlib.util
import os
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .cache_keys import file_identity, library_majors
from . import MissingWeightsError
from .canny import cv2_module
from .pose_render import Person, render

DETECTOR_FILE = "yolox_l.onnx"
POSE_FILE = "dw-ll_ucoco_384.onnx"
AUX_ENV = "AUX_ANNOTATOR_CKPTS_PATH"
# comfyui_controlnet_aux's ckpts layout: <ckpts>/<hf repo id>/<file>
AUX_SUBDIRS = ("yzd-v/DWPose", "hr16/yolox-onnx", "hr16/DWPose-TorchScript-BatchSize5", "")

SCORE_THRESHOLD = 0.3
DET_SCORE_THRESHOLD = 0.3
DET_NMS_IOU = 0.45
BOX_PADDING = 1.25
MEAN = np.array([123.675, 116.28, 103.53], np.float32)
STD = np.array([58.395, 57.12, 57.375], np.float32)
# OpenPose body index -> COCO index (-1 = neck, the midpoint of the shoulders).
OPENPOSE_FROM_COCO = (0, -1, 6, 8, 10, 5, 7, 9, 12, 14, 16, 11, 13, 15, 2, 1, 4, 3)
FACE = slice(23, 91)
LEFT_HAND = slice(91, 112)
RIGHT_HAND = slice(112, 133)

_sessions: "OrderedDict[tuple, object]" = OrderedDict()
_sessions_lock = threading.Lock()


# ------------------------------------------------------------------------------------ locating
def aux_ckpts_dirs(extra: Sequence[str] = ()) -> list[str]:
    """comfyui_controlnet_aux checkpoint roots: $AUX_ANNOTATOR_CKPTS_PATH first, then `extra`."""
    roots = []
    env = os.environ.get(AUX_ENV, "").strip()
    if env:
        roots.append(os.path.expanduser(env))
    roots.extend(extra)
    return roots


def pose_search_dirs(pose_dirs: Sequence[str] = (), aux_roots: Sequence[str] = ()) -> list[str]:
    """Folders searched for the ONNX files, in order: our pose folders, then the aux ckpts layout."""
    dirs = list(pose_dirs)
    for root in aux_ckpts_dirs(aux_roots):
        dirs.extend(os.path.join(root, sub) if sub else root for sub in AUX_SUBDIRS)
    seen, out = set(), []
    for d in dirs:
        k = os.path.normcase(os.path.abspath(d))
        if k not in seen:
            seen.add(k)
            out.append(d)
    return out


def find_model_file(name: str, search_dirs: Sequence[str]) -> str | None:
    name = os.path.expanduser(name.strip())
    if os.path.isabs(name):
        return name if os.path.isfile(name) else None
    for d in search_dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return os.path.abspath(p)
    return None


def list_onnx_files(search_dirs: Sequence[str]) -> list[str]:
    names = set()
    for d in search_dirs:
        try:
            names.update(e.name for e in os.scandir(d) if e.is_file() and e.name.endswith(".onnx"))
        except OSError:
            continue
    return sorted(names)


def require_onnxruntime():
    if importlib.util.find_spec("onnxruntime") is None:
        raise RuntimeError("SD Accel pose: the `onnxruntime` package is not installed, and the DWPose "
                           "models need it. Install it into ComfyUI's Python: `pip install onnxruntime` "
                           "(or `onnxruntime-gpu` for CUDA).")
    import onnxruntime
    return onnxruntime


def _session(path: str, providers: Sequence[str] | None):
    ort = require_onnxruntime()
    st = os.stat(path)
    avail = ort.get_available_providers()
    if providers is None:
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]
    key = (path, st.st_size, st.st_mtime_ns, tuple(providers))
    with _sessions_lock:
        s = _sessions.get(key)
        if s is not None:
            _sessions.move_to_end(key)
            return s
        try:
            s = ort.InferenceSession(path, providers=list(providers))
        except Exception:  # noqa: BLE001 - e.g. a CUDA provider that cannot start: use the CPU
            if list(providers) == ["CPUExecutionProvider"]:
                raise
            s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        while len(_sessions) >= 4:
            _sessions.popitem(last=False)
        _sessions[key] = s
        return s


def _input_hw(session, default):
    shape = session.get_inputs()[0].shape
    if len(shape) == 4 and all(isinstance(v, int) and v > 0 for v in shape[2:]):
        return int(shape[2]), int(shape[3])
    return default


# ------------------------------------------------------------------------------------- geometry
def resize_linear(img: np.ndarray, width: int, height: int) -> np.ndarray:
    cv2 = cv2_module()
    if cv2 is not None:
        return cv2.resize(img, (width, height), interpolation=cv2.INTER_LINEAR)
    t = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None].float()
    t = F.interpolate(t, size=(height, width), mode="bilinear", align_corners=False)
    return t[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def letterbox(img: np.ndarray, in_h: int, in_w: int) -> tuple[np.ndarray, float]:
    """Resize keeping the aspect ratio into the top-left of an (in_h, in_w) grey-114 canvas."""
    ratio = min(in_h / img.shape[0], in_w / img.shape[1])
    nh, nw = int(img.shape[0] * ratio), int(img.shape[1] * ratio)
    out = np.full((in_h, in_w, 3), 114, np.uint8)
    out[:nh, :nw] = resize_linear(img, nw, nh)
    return out, ratio


def warp_affine(img: np.ndarray, m: np.ndarray, out_w: int, out_h: int) -> np.ndarray:
    """Bilinear warp with a 2x3 src->dst matrix, zeros outside (float32 output)."""
    cv2 = cv2_module()
    if cv2 is not None:
        return cv2.warpAffine(img, m, (out_w, out_h), flags=cv2.INTER_LINEAR).astype(np.float32)
    inv = np.linalg.inv(np.vstack([m, [0, 0, 1]]))[:2]
    v, u = np.mgrid[0:out_h, 0:out_w].astype(np.float64)
    sx = inv[0, 0] * u + inv[0, 1] * v + inv[0, 2]
    sy = inv[1, 0] * u + inv[1, 1] * v + inv[1, 2]
    h, w = img.shape[:2]
    grid = np.stack([2 * sx / max(w - 1, 1) - 1, 2 * sy / max(h - 1, 1) - 1], -1)
    t = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None].float()
    g = torch.from_numpy(grid).float()[None]
    out = F.grid_sample(t, g, mode="bilinear", padding_mode="zeros", align_corners=True)
    return out[0].permute(1, 2, 0).numpy()


def box_to_center_scale(box, in_w: int, in_h: int):
    x1, y1, x2, y2 = (float(v) for v in box)
    center = np.array([(x1 + x2) / 2, (y1 + y2) / 2])
    w, h = (x2 - x1) * BOX_PADDING, (y2 - y1) * BOX_PADDING
    aspect = in_w / in_h
    if w > h * aspect:
        h = w / aspect
    else:
        w = h * aspect
    return center, np.array([w, h])


def crop_matrix(center, scale, in_w: int, in_h: int) -> np.ndarray:
    """2x3 matrix mapping image pixels into the (in_w, in_h) crop of `scale` around `center`."""
    sx, sy = in_w / scale[0], in_h / scale[1]
    return np.array([[sx, 0, in_w / 2 - center[0] * sx], [0, sy, in_h / 2 - center[1] * sy]], np.float64)


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float) -> list[int]:
    order = np.argsort(-scores, kind="stable")
    area = np.maximum(boxes[:, 2] - boxes[:, 0], 0) * np.maximum(boxes[:, 3] - boxes[:, 1], 0)
    keep = []
    while order.size:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        xx1 = np.maximum(boxes[i, 0], boxes[rest, 0])
        yy1 = np.maximum(boxes[i, 1], boxes[rest, 1])
        xx2 = np.minimum(boxes[i, 2], boxes[rest, 2])
        yy2 = np.minimum(boxes[i, 3], boxes[rest, 3])
        inter = np.maximum(xx2 - xx1, 0) * np.maximum(yy2 - yy1, 0)
        ovr = inter / np.maximum(area[i] + area[rest] - inter, 1e-9)
        order = rest[ovr <= iou]
    return keep


def decode_yolox(raw: np.ndarray, in_h: int, in_w: int) -> tuple[np.ndarray, np.ndarray]:
    """YOLOX raw head (N, 5 + C) -> boxes xyxy (N, 4) in input pixels, person scores (N,)."""
    grids, strides = [], []
    for s in (8, 16, 32):
        gh, gw = in_h // s, in_w // s
        ys, xs = np.mgrid[0:gh, 0:gw]
        grids.append(np.stack([xs.ravel(), ys.ravel()], -1))
        strides.append(np.full((gh * gw, 1), s))
    grid = np.concatenate(grids).astype(np.float32)
    stride = np.concatenate(strides).astype(np.float32)
    if grid.shape[0] != raw.shape[0]:
        raise ValueError(f"detector output has {raw.shape[0]} anchors, expected {grid.shape[0]} for a "
                         f"{in_w}x{in_h} YOLOX input")
    xy = (raw[:, :2] + grid) * stride
    wh = np.exp(np.clip(raw[:, 2:4], -20, 20)) * stride
    boxes = np.concatenate([xy - wh / 2, xy + wh / 2], -1)
    return boxes, raw[:, 4] * raw[:, 5]


def detect_people(session, img: np.ndarray) -> np.ndarray:
    """Person boxes (K, 4) xyxy in `img` pixels."""
    in_h, in_w = _input_hw(session, (640, 640))
    padded, ratio = letterbox(img, in_h, in_w)
    x = padded.transpose(2, 0, 1)[None].astype(np.float32)
    outs = session.run(None, {session.get_inputs()[0].name: x})
    if len(outs) >= 2 and outs[0].ndim == 3 and outs[0].shape[-1] == 5:  # mmdeploy end2end
        dets, labels = outs[0][0], outs[1][0].reshape(-1)
        keep = (labels == 0) & (dets[:, 4] > DET_SCORE_THRESHOLD)
        return dets[keep, :4].astype(np.float64) / ratio
    raw = outs[0].reshape(-1, outs[0].shape[-1]).astype(np.float32)
    boxes, scores = decode_yolox(raw, in_h, in_w)
    cand = np.nonzero(scores > DET_SCORE_THRESHOLD)[0]
    if cand.size == 0:
        return np.zeros((0, 4))
    keep = nms(boxes[cand], scores[cand], DET_NMS_IOU)
    return boxes[cand[keep]].astype(np.float64) / ratio


def estimate_keypoints(session, img: np.ndarray, boxes: np.ndarray):
    """Whole-body keypoints (P, K, 2) in image pixels and scores (P, K) for each box."""
    in_h, in_w = _input_hw(session, (384, 288))
    name = session.get_inputs()[0].name
    out_names = [o.name for o in session.get_outputs()]
    kps, scs = [], []
    for box in boxes:
        center, scale = box_to_center_scale(box, in_w, in_h)
        crop = warp_affine(img, crop_matrix(center, scale, in_w, in_h), in_w, in_h)
        x = ((crop - MEAN) / STD).transpose(2, 0, 1)[None].astype(np.float32)
        outs = dict(zip(out_names, session.run(None, {name: x})))
        simcc_x, simcc_y = (outs["simcc_x"], outs["simcc_y"]) if "simcc_x" in outs else list(outs.values())[:2]
        sx, sy = simcc_x[0], simcc_y[0]
        ratio_x, ratio_y = sx.shape[-1] / in_w, sy.shape[-1] / in_h
        loc = np.stack([sx.argmax(-1) / ratio_x, sy.argmax(-1) / ratio_y], -1).astype(np.float64)
        score = np.minimum(sx.max(-1), sy.max(-1)).astype(np.float64)
        kps.append(loc / [in_w, in_h] * scale + center - scale / 2)
        scs.append(score)
    if not kps:
        return np.zeros((0, 133, 2)), np.zeros((0, 133))
    return np.stack(kps), np.stack(scs)


def to_people(keypoints: np.ndarray, scores: np.ndarray) -> list[Person]:
    """COCO-WholeBody (P, 133) -> Person(OpenPose body 18, hands 21, face 68 + the two eyes)."""
    people = []
    for kp, sc in zip(keypoints, scores):
        pts = np.concatenate([kp, sc[:, None]], -1)
        body = np.zeros((18, 3))
        for op, coco in enumerate(OPENPOSE_FROM_COCO):
            if coco >= 0:
                body[op] = pts[coco]
            else:
                both = pts[5, 2] >= SCORE_THRESHOLD and pts[6, 2] >= SCORE_THRESHOLD
                body[op] = [*(pts[5, :2] + pts[6, :2]) / 2, 1.0 if both else 0.0]
        face = pts[FACE] if pts.shape[0] >= 91 else None
        if face is not None:
            face = np.concatenate([face, body[[14, 15]]])  # OpenPose faces have 70 points: + eyes
        people.append(Person(body=body,
                             left_hand=pts[LEFT_HAND] if pts.shape[0] >= 112 else None,
                             right_hand=pts[RIGHT_HAND] if pts.shape[0] >= 133 else None,
                             face=face))
    return people


class PosePreprocessor:
    """OpenPose-style whole-body pose image from the DWPose ONNX models (see module docstring)."""

    name = "pose"
    channels = 3

    def __init__(self, detector: str = DETECTOR_FILE, pose_model: str = POSE_FILE,
                 search_dirs: Sequence[str] = (), include_body: bool = True, include_hands: bool = True,
                 include_face: bool = True, providers: Sequence[str] | None = None):
        require_onnxruntime()
        self.search_dirs = list(search_dirs) or pose_search_dirs()
        det = find_model_file(detector, self.search_dirs)
        pose = find_model_file(pose_model, self.search_dirs)
        missing = [n for n, p in ((detector, det), (pose_model, pose)) if p is None]
        if missing:
            raise MissingWeightsError(
                "pose (DWPose)", [os.path.basename(m) for m in missing], self.search_dirs,
                hint="They are the yzd-v/DWPose files; comfyui_controlnet_aux keeps them in "
                     "ckpts/yzd-v/DWPose/ (its location can be moved with AUX_ANNOTATOR_CKPTS_PATH).")
        self.detector_path, self.pose_path = det, pose
        self.body, self.hands, self.face = bool(include_body), bool(include_hands), bool(include_face)
        self.providers = providers

    def spec(self) -> dict:
        warp = "cv2" if cv2_module() is not None else "torch"
        libs = library_majors(("onnxruntime",))
        if warp == "cv2":
            libs["cv2"] = cv2_module().__version__.split(".")[0]
        return {"preprocessor": self.name, "implementation": f"dwpose-onnx/{warp}",
                "params": {"include_body": self.body, "include_hands": self.hands,
                           "include_face": self.face, "score_threshold": SCORE_THRESHOLD},
                "weights": {"detector": file_identity(self.detector_path),
                            "pose": file_identity(self.pose_path)},
                "libs": libs}

    def keypoints(self, img: np.ndarray):
        det = _session(self.detector_path, self.providers)
        pose = _session(self.pose_path, self.providers)
        boxes = detect_people(det, img)
        return boxes, *estimate_keypoints(pose, img, boxes)

    def compute(self, frames: np.ndarray) -> list[np.ndarray]:
        out = []
        for img in frames:
            img = np.ascontiguousarray(img)
            _, kps, scores = self.keypoints(img)
            out.append(render(img.shape[0], img.shape[1], to_people(kps, scores),
                              body=self.body, hands=self.hands, face=self.face,
                              threshold=SCORE_THRESHOLD))
        return out
