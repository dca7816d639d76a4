"""Tiny random models for the preprocessor tests (no network, well under 1 MB each).

Reusable outside pytest: `make_tiny_depth_model(folder)` writes a transformers Depth Anything V2
checkpoint; `make_tiny_pose_models(folder)` writes a fake YOLOX detector (`yolox_l.onnx`) and a
random SimCC whole-body pose model (`dw-ll_ucoco_384.onnx`) with the same input/output signatures
as the DWPose files. Point a ComfyUI server's `models/depth/<name>` and `models/pose/` at them to
exercise the nodes end to end.
"""
from __future__ import annotations

import math
import os

import numpy as np

# Person boxes the fake detector reports, in its 640x640 letterboxed input space (x1, y1, x2, y2).
DEFAULT_BOXES = ((150.0, 60.0, 470.0, 630.0),)


def make_tiny_depth_model(folder: str, kind: str = "depth_anything", size: int = 140, seed: int = 0) -> str:
    """Save a random tiny depth model + image processor with `save_pretrained` into `folder`.

    kind: "depth_anything" (Depth Anything V2 layout, DINOv2 backbone) or "dpt" (DPT / MiDaS v3).
    size: the processor's resize target (a multiple of 14 for depth_anything; small keeps tests fast)."""
    import torch
    from transformers import DPTImageProcessor

    torch.manual_seed(seed)
    os.makedirs(folder, exist_ok=True)
    if kind == "depth_anything":
        from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation, Dinov2Config
        backbone = Dinov2Config(image_size=518, patch_size=14, hidden_size=32, num_hidden_layers=4,
                                num_attention_heads=2, intermediate_size=64,
                                out_features=["stage1", "stage2", "stage3", "stage4"],
                                reshape_hidden_states=False)
        cfg = DepthAnythingConfig(backbone_config=backbone, neck_hidden_sizes=[16, 32, 32, 32],
                                  fusion_hidden_size=16, head_hidden_size=8, reassemble_hidden_size=32)
        model = DepthAnythingForDepthEstimation(cfg)
        multiple = 14
    elif kind == "dpt":
        from transformers import DPTConfig, DPTForDepthEstimation
        cfg = DPTConfig(image_size=size, patch_size=16, hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=2, intermediate_size=64, neck_hidden_sizes=[8, 16, 32, 32],
                        fusion_hidden_size=16, backbone_out_indices=[0, 1, 2, 3], head_in_index=-1)
        model = DPTForDepthEstimation(cfg)
        multiple = 32
    else:
        raise ValueError(f"kind must be depth_anything or dpt, got {kind!r}")
    model.save_pretrained(folder, safe_serialization=True)
    DPTImageProcessor(size={"height": size, "width": size}, keep_aspect_ratio=True,
                      ensure_multiple_of=multiple, resample=3, do_rescale=True, do_normalize=True,
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return folder


def _save(model, path):
    import onnx
    onnx.checker.check_model(model)
    onnx.save(model, path)


def make_fake_yolox(path: str, boxes=DEFAULT_BOXES, input_size: int = 640, end2end: bool = False) -> str:
    """A detector ONNX that ignores its image and reports `boxes` (class 0, "person").

    Default output is YOLOX's raw head, (1, N, 85) over the stride 8/16/32 grids, as in DWPose's
    `yolox_l.onnx`: each box is written on one stride-32 anchor as (dx, dy, log w, log h) with
    objectness and class score 0.95. end2end=True writes the mmdeploy format instead:
    `dets` (1, K, 5) [x1, y1, x2, y2, score] and `labels` (1, K) int64."""
    from onnx import TensorProto, helper, numpy_helper

    inp = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, input_size, input_size])
    # Depend on the input so the graph is a real function of it (the value is multiplied by 0).
    nodes = [helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0),
             helper.make_node("Mul", ["mean", "zero"], ["zero_like"])]
    inits = [numpy_helper.from_array(np.zeros(1, np.float32), "zero")]
    if end2end:
        dets = np.array([[*b, 0.95] for b in boxes], np.float32).reshape(1, -1, 5)
        labels = np.zeros((1, len(boxes)), np.int64)
        inits += [numpy_helper.from_array(dets, "dets_c"), numpy_helper.from_array(labels, "labels")]
        nodes += [helper.make_node("Add", ["dets_c", "zero_like"], ["dets"]),
                  helper.make_node("Identity", ["labels"], ["labels_out"])]
        outs = [helper.make_tensor_value_info("dets", TensorProto.FLOAT, [1, len(boxes), 5]),
                helper.make_tensor_value_info("labels_out", TensorProto.INT64, [1, len(boxes)])]
    else:
        strides = (8, 16, 32)
        sizes = [(input_size // s) ** 2 for s in strides]
        n = sum(sizes)
        offset32 = sizes[0] + sizes[1]
        g = input_size // 32
        rows = {}
        for x1, y1, x2, y2 in boxes:
            cx, cy, w, h = (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1
            gx, gy = int(cx // 32), int(cy // 32)
            row = np.zeros(85, np.float32)
            row[:4] = (cx / 32 - gx, cy / 32 - gy, math.log(w / 32), math.log(h / 32))
            row[4] = row[5] = 0.95
            rows[offset32 + gy * g + gx] = row
        if not rows:  # no person: one all-zero anchor
            rows[0] = np.zeros(85, np.float32)
        # Sparse constant: zeros everywhere but the box anchors (keeps the file tiny).
        idx = np.array(sorted(rows), np.int64)
        vals = np.stack([rows[i] for i in idx])[None]
        inits += [numpy_helper.from_array(np.stack([np.zeros_like(idx), idx], -1)[None], "scatter_idx"),
                  numpy_helper.from_array(vals, "scatter_vals"),
                  numpy_helper.from_array(np.array([1, n, 85], np.int64), "full_shape")]
        nodes += [helper.make_node("ConstantOfShape", ["full_shape"], ["zeros"],
                                   value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])),
                  helper.make_node("ScatterND", ["zeros", "scatter_idx", "scatter_vals"], ["raw"]),
                  helper.make_node("Add", ["raw", "zero_like"], ["output"])]
        outs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, n, 85])]
    graph = helper.make_graph(nodes, "fake_yolox", [inp], outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _save(model, path)
    return path


def make_random_simcc(path: str, num_keypoints: int = 133, input_hw=(384, 288), split_ratio: float = 2.0,
                      rank: int = 8, hidden: int = 16, seed: int = 0) -> str:
    """A random-weight SimCC pose ONNX with DWPose's signature: `input` (1, 3, H, W) ->
    `simcc_x` (1, K, W * ratio), `simcc_y` (1, K, H * ratio). Low-rank, so the file stays tiny;
    outputs depend on the image, and their maxima are well above DWPose's 0.3 score threshold."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    h, w = input_hw
    wx, wy = int(w * split_ratio), int(h * split_ratio)
    pool = 32
    feat = 3 * (h // pool) * (w // pool)
    w1 = (rng.standard_normal((feat, hidden)) / math.sqrt(feat)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, num_keypoints * rank)) * 2).astype(np.float32)
    bx = rng.standard_normal((rank, wx)).astype(np.float32)
    by = rng.standard_normal((rank, wy)).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in
             ((w1, "w1"), (w2, "w2"), (bx, "bx"), (by, "by"),
              (np.array([1, -1], np.int64), "flat"), (np.array([1, num_keypoints, rank], np.int64), "kr"))]
    nodes = [helper.make_node("AveragePool", ["input"], ["pooled"], kernel_shape=[pool, pool], strides=[pool, pool]),
             helper.make_node("Reshape", ["pooled", "flat"], ["f"]),
             helper.make_node("MatMul", ["f", "w1"], ["h0"]),
             helper.make_node("Tanh", ["h0"], ["h1"]),
             helper.make_node("MatMul", ["h1", "w2"], ["p0"]),
             helper.make_node("Reshape", ["p0", "kr"], ["p"]),
             helper.make_node("MatMul", ["p", "bx"], ["sx"]),
             helper.make_node("MatMul", ["p", "by"], ["sy"]),
             helper.make_node("Identity", ["sx"], ["simcc_x"]),
             helper.make_node("Identity", ["sy"], ["simcc_y"])]
    graph = helper.make_graph(
        nodes, "random_simcc",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, h, w])],
        [helper.make_tensor_value_info("simcc_x", TensorProto.FLOAT, [1, num_keypoints, wx]),
         helper.make_tensor_value_info("simcc_y", TensorProto.FLOAT, [1, num_keypoints, wy])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _save(model, path)
    return path


def make_tiny_pose_models(folder: str, boxes=DEFAULT_BOXES, end2end: bool = False, seed: int = 0) -> str:
    """Write `yolox_l.onnx` (fake detector reporting `boxes`) and `dw-ll_ucoco_384.onnx` (random
    SimCC, 133 whole-body keypoints, 288x384 input) into `folder`. Returns `folder`."""
    os.makedirs(folder, exist_ok=True)
    make_fake_yolox(os.path.join(folder, "yolox_l.onnx"), boxes=boxes, end2end=end2end)
    make_random_simcc(os.path.join(folder, "dw-ll_ucoco_384.onnx"), seed=seed)
    return folder
