"""OpenPose-style skeleton renderer (the look ControlNet's openpose models were trained on), in numpy.

Conventions of the ControlNet annotator (reimplemented here, no OpenCV needed):
  - black background, RGB;
  - body: 18 OpenPose keypoints (0 nose, 1 neck, 2-4 right arm, 5-7 left arm, 8-10 right leg,
    11-13 left leg, 14/15 right/left eye, 16/17 right/left ear) and 17 limbs, each a filled
    ellipse of half-width 4 px along the limb in 60% of its colour, then a disc of radius 4 px at
    every keypoint in its full colour, from the fixed 18-colour table below;
  - hands: 20 bones as 2 px lines coloured around the HSV hue circle, and blue keypoint discs;
  - face: white discs of radius 3 px.
Sizes are for a 512 px short side (the annotator's detect resolution) and scale with the canvas.
A keypoint is drawn when its score is at least `threshold`.
"""
from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

import numpy as np

BODY_COLORS = (
    (255, 0, 0), (255, 85, 0), (255, 170, 0), (255, 255, 0), (170, 255, 0), (85, 255, 0),
    (0, 255, 0), (0, 255, 85), (0, 255, 170), (0, 255, 255), (0, 170, 255), (0, 85, 255),
    (0, 0, 255), (85, 0, 255), (170, 0, 255), (255, 0, 255), (255, 0, 170), (255, 0, 85),
)
# Limbs as (keypoint a, keypoint b), 0-based; limb i is drawn in BODY_COLORS[i].
BODY_LIMBS = (
    (1, 2), (1, 5), (2, 3), (3, 4), (5, 6), (6, 7), (1, 8), (8, 9), (9, 10),
    (1, 11), (11, 12), (12, 13), (1, 0), (0, 14), (14, 16), (0, 15), (15, 17),
)
HAND_BONES = tuple((0 if j % 4 == 0 else j, j + 1) for j in range(20))  # wrist -> 5 fingers of 4 bones
HAND_POINT_COLOR = (0, 0, 255)
FACE_COLOR = (255, 255, 255)
LIMB_DIM = 0.6
BASE_SIDE = 512.0


def hand_bone_color(i: int) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb(i / len(HAND_BONES), 1.0, 1.0)
    return (round(r * 255), round(g * 255), round(b * 255))


def limb_color(i: int) -> tuple[int, int, int]:
    return tuple(int(c * LIMB_DIM) for c in BODY_COLORS[i])


@dataclass
class Person:
    """Keypoints in canvas pixels, each row (x, y, score). Any part may be None."""
    body: np.ndarray | None = None        # (18, 3), OpenPose order
    left_hand: np.ndarray | None = None   # (21, 3)
    right_hand: np.ndarray | None = None  # (21, 3)
    face: np.ndarray | None = None        # (68 or 70, 3)


# ------------------------------------------------------------------------------ raster primitives
def _window(canvas, x0, y0, x1, y1):
    h, w = canvas.shape[:2]
    xa, ya = max(int(math.floor(x0)), 0), max(int(math.floor(y0)), 0)
    xb, yb = min(int(math.ceil(x1)) + 1, w), min(int(math.ceil(y1)) + 1, h)
    if xa >= xb or ya >= yb:
        return None
    ys, xs = np.mgrid[ya:yb, xa:xb]
    return ya, yb, xa, xb, xs.astype(np.float64), ys.astype(np.float64)


def fill_ellipse(canvas, cx, cy, a, b, angle_deg, color):
    """Filled ellipse, semi-axes a (along angle) and b, centred at pixel (cx, cy)."""
    a, b = max(a, 0.5), max(b, 0.5)
    t = math.radians(angle_deg)
    c, s = math.cos(t), math.sin(t)
    ex = math.sqrt((a * c) ** 2 + (b * s) ** 2)
    ey = math.sqrt((a * s) ** 2 + (b * c) ** 2)
    win = _window(canvas, cx - ex, cy - ey, cx + ex, cy + ey)
    if win is None:
        return
    ya, yb, xa, xb, xs, ys = win
    dx, dy = xs - cx, ys - cy
    u = (dx * c + dy * s) / a
    v = (-dx * s + dy * c) / b
    canvas[ya:yb, xa:xb][u * u + v * v <= 1.0] = color


def fill_circle(canvas, cx, cy, r, color):
    win = _window(canvas, cx - r, cy - r, cx + r, cy + r)
    if win is None:
        return
    ya, yb, xa, xb, xs, ys = win
    canvas[ya:yb, xa:xb][(xs - cx) ** 2 + (ys - cy) ** 2 <= r * r] = color


def draw_segment(canvas, x0, y0, x1, y1, thickness, color):
    """A line of the given thickness with round ends (pixels within thickness/2 of the segment)."""
    r = max(thickness / 2.0, 0.5)
    win = _window(canvas, min(x0, x1) - r, min(y0, y1) - r, max(x0, x1) + r, max(y0, y1) + r)
    if win is None:
        return
    ya, yb, xa, xb, xs, ys = win
    vx, vy = x1 - x0, y1 - y0
    ll = vx * vx + vy * vy
    t = np.zeros_like(xs) if ll == 0 else np.clip(((xs - x0) * vx + (ys - y0) * vy) / ll, 0.0, 1.0)
    d2 = (xs - (x0 + t * vx)) ** 2 + (ys - (y0 + t * vy)) ** 2
    canvas[ya:yb, xa:xb][d2 <= r * r] = color


# ---------------------------------------------------------------------------------------- parts
def draw_body(canvas, kp, threshold=0.3, scale=1.0):
    ok = kp[:, 2] >= threshold
    for i, (a, b) in enumerate(BODY_LIMBS):
        if not (ok[a] and ok[b]):
            continue
        (xa, ya), (xb, yb) = kp[a, :2], kp[b, :2]
        length = math.hypot(xa - xb, ya - yb)
        angle = math.degrees(math.atan2(ya - yb, xa - xb))
        fill_ellipse(canvas, int((xa + xb) / 2), int((ya + yb) / 2), int(length / 2), 4 * scale,
                     int(angle), limb_color(i))
    for i in range(min(len(kp), 18)):
        if ok[i]:
            fill_circle(canvas, int(kp[i, 0]), int(kp[i, 1]), 4 * scale, BODY_COLORS[i])


def draw_hand(canvas, kp, threshold=0.3, scale=1.0):
    ok = kp[:, 2] >= threshold
    for i, (a, b) in enumerate(HAND_BONES):
        if ok[a] and ok[b]:
            draw_segment(canvas, int(kp[a, 0]), int(kp[a, 1]), int(kp[b, 0]), int(kp[b, 1]),
                         2 * scale, hand_bone_color(i))
    for i in range(len(kp)):
        if ok[i]:
            fill_circle(canvas, int(kp[i, 0]), int(kp[i, 1]), 4 * scale, HAND_POINT_COLOR)


def draw_face(canvas, kp, threshold=0.3, scale=1.0):
    for x, y, s in kp:
        if s >= threshold:
            fill_circle(canvas, int(x), int(y), 3 * scale, FACE_COLOR)


def render(height: int, width: int, people, body: bool = True, hands: bool = True, face: bool = True,
           threshold: float = 0.3, scale: float | None = None) -> np.ndarray:
    """uint8 RGB (height, width, 3) OpenPose image of `people` (a list of Person) on black.

    scale: stroke size multiplier; None = short side / 512, so the picture matches the annotator's
    512 px rendering scaled to this size."""
    canvas = np.zeros((height, width, 3), dtype=np.uint8)
    s = min(height, width) / BASE_SIDE if scale is None else float(scale)
    for p in people:
        if body and p.body is not None:
            draw_body(canvas, np.asarray(p.body, np.float64), threshold, s)
        if hands:
            for hk in (p.left_hand, p.right_hand):
                if hk is not None:
                    draw_hand(canvas, np.asarray(hk, np.float64), threshold, s)
        if face and p.face is not None:
            draw_face(canvas, np.asarray(p.face, np.float64), threshold, s)
    return canvas
