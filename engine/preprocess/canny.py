"""Canny edge maps: `cv2.Canny` when OpenCV imports, else a torch port of the same algorithm.

Both take cv2's conventions: uint8 grey input (RGB -> grey with cv2's fixed-point weights), an
optional Gaussian blur (kernel 3, 5 or 7 with cv2's sigma=0 tables), a 3x3 Sobel,
L1 or L2 magnitude, thresholds on the 0-255 scale, non-maximum suppression along the gradient
rounded to 45 degrees, and 8-connected hysteresis. The torch port does hysteresis with
`scipy.ndimage.label` (keep weak components that touch a strong pixel) in one pass; it never uses
kornia's iterative hysteresis, which takes 16-69 s per 1024x1024 image on CPU.

The torch port reproduces cv2 4.x/5.x bit for bit on the photos we test (grey conversion and blur
in cv2's fixed point included); the implementation ("cv2" or "torch") is still part of the cache
key, since other OpenCV builds may differ.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

IMPL_CV2 = "cv2"
IMPL_TORCH = "torch"


def cv2_module():
    """The cv2 module, or None when OpenCV is not importable (it is optional for this pack)."""
    try:
        import cv2
        cv2.Canny  # noqa: B018 - a half-installed cv2 (two wheels clobbering each other) fails here
        return cv2
    except Exception:  # noqa: BLE001
        return None


def rgb_to_gray(rgb: np.ndarray) -> np.ndarray:
    """uint8 RGB (H, W, 3) -> uint8 grey, with cv2's 15-bit fixed-point BT.601 weights and rounding."""
    r, g, b = (rgb[..., i].astype(np.int32) for i in range(3))
    return ((r * 9798 + g * 19235 + b * 3735 + (1 << 14)) >> 15).astype(np.uint8)


# cv2.getGaussianKernel's fixed tables for sigma <= 0, as multiples of 1/256 (its 8-bit fixed point).
_GAUSS_256 = {3: (64, 128, 64), 5: (16, 64, 96, 64, 16), 7: (8, 28, 56, 72, 56, 28, 8)}
BLUR_SIZES = (0, 3, 5, 7)


def canny_cv2(gray: np.ndarray, low: float, high: float, blur: int = 0, l2: bool = False) -> np.ndarray:
    cv2 = cv2_module()
    if cv2 is None:
        raise RuntimeError("OpenCV (cv2) is not importable; use implementation='torch'")
    if blur:
        gray = cv2.GaussianBlur(gray, (blur, blur), 0)
    return cv2.Canny(gray, float(low), float(high), apertureSize=3, L2gradient=bool(l2))


def _blur_torch(x: torch.Tensor, ksize: int) -> torch.Tensor:
    """cv2.GaussianBlur(u8, (k, k), 0) bit for bit: 8-bit fixed-point taps, rounding at the end."""
    k = torch.tensor(_GAUSS_256[ksize], dtype=torch.float64)
    r = ksize // 2
    x = F.pad(x.double(), (r, r, r, r), mode="reflect")  # cv2's default BORDER_REFLECT_101
    x = F.conv2d(x, k.view(1, 1, 1, -1))
    x = F.conv2d(x, k.view(1, 1, -1, 1))  # exact integers, at most 255 * 2^16
    return torch.floor((x + 32768) / 65536).float()


def hysteresis(candidates: np.ndarray, strong: np.ndarray) -> np.ndarray:
    """Keep the 8-connected components of `candidates` that contain a `strong` pixel (bool arrays)."""
    from scipy import ndimage
    labels, n = ndimage.label(candidates, structure=np.ones((3, 3), dtype=bool))
    keep = np.zeros(n + 1, dtype=bool)
    keep[labels[strong & candidates]] = True
    keep[0] = False
    return keep[labels]


def canny_torch(gray: np.ndarray, low: float, high: float, blur: int = 0, l2: bool = False) -> np.ndarray:
    """cv2.Canny semantics in torch + scipy. gray: uint8 (H, W). Returns uint8 {0, 255}."""
    if low > high:
        low, high = high, low
    x = torch.from_numpy(np.ascontiguousarray(gray)).float()[None, None]
    if blur:
        x = _blur_torch(x, blur)
    xp = F.pad(x, (1, 1, 1, 1), mode="replicate")
    sob = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
    gx = F.conv2d(xp, sob.view(1, 1, 3, 3))[0, 0].to(torch.int64)
    gy = F.conv2d(xp, sob.t().contiguous().view(1, 1, 3, 3))[0, 0].to(torch.int64)
    if l2:
        mag = gx * gx + gy * gy
        lo = math.floor(min(low, 32767.0) ** 2)
        hi = math.floor(min(high, 32767.0) ** 2)
    else:
        mag = gx.abs() + gy.abs()
        lo, hi = math.floor(low), math.floor(high)
    m = F.pad(mag, (1, 1, 1, 1))  # zero magnitude outside the image, as cv2
    left, right = m[1:-1, :-2], m[1:-1, 2:]
    up, down = m[:-2, 1:-1], m[2:, 1:-1]
    ax, ay = gx.abs(), gy.abs()
    # Direction tests in cv2's fixed point: tan(22.5 deg) = 13573 / 2^15.
    tg22 = ax * 13573
    ay15 = ay << 15
    horizontal = ay15 < tg22
    vertical = ay15 > tg22 + (ax << 16)
    same_sign = (gx < 0) == (gy < 0)
    diag_a = torch.where(same_sign, m[:-2, :-2], m[:-2, 2:])   # up-left / up-right
    diag_b = torch.where(same_sign, m[2:, 2:], m[2:, :-2])     # down-right / down-left
    keep = torch.where(horizontal, (mag > left) & (mag >= right),
                       torch.where(vertical, (mag > up) & (mag >= down),
                                   (mag > diag_a) & (mag > diag_b)))
    cand = keep & (mag > lo)
    strong = cand & (mag > hi)
    edges = hysteresis(cand.numpy(), strong.numpy())
    return edges.astype(np.uint8) * 255


class CannyPreprocessor:
    """Canny edges, white on black. Parameters follow cv2.Canny (thresholds on the 0-255 scale)."""

    name = "canny"
    channels = 1

    def __init__(self, low_threshold: float = 100, high_threshold: float = 200, blur: int = 0,
                 l2_gradient: bool = False, implementation: str = "auto"):
        if int(blur) not in BLUR_SIZES:
            raise ValueError(f"blur must be one of {BLUR_SIZES} (0 = off), got {blur}")
        if implementation == "auto":
            implementation = IMPL_CV2 if cv2_module() is not None else IMPL_TORCH
        if implementation not in (IMPL_CV2, IMPL_TORCH):
            raise ValueError(f"implementation must be auto, cv2 or torch, got {implementation!r}")
        self.low = float(low_threshold)
        self.high = float(high_threshold)
        self.blur = int(blur)
        self.l2 = bool(l2_gradient)
        self.implementation = implementation

    def spec(self) -> dict:
        if self.implementation == IMPL_CV2:
            libs = {"cv2": cv2_module().__version__.split(".")[0]}
        else:
            import scipy
            libs = {"torch": torch.__version__.split(".")[0], "scipy": scipy.__version__.split(".")[0]}
        return {"preprocessor": self.name, "implementation": self.implementation, "libs": libs,
                "params": {"low_threshold": self.low, "high_threshold": self.high,
                           "blur": self.blur, "l2_gradient": self.l2}}

    def compute(self, frames: np.ndarray) -> list[np.ndarray]:
        fn = canny_cv2 if self.implementation == IMPL_CV2 else canny_torch
        out = []
        for rgb in frames:
            gray = rgb_to_gray(rgb) if self.implementation == IMPL_TORCH else _cv2_gray(rgb)
            out.append(fn(gray, self.low, self.high, self.blur, self.l2))
        return out


def _cv2_gray(rgb: np.ndarray) -> np.ndarray:
    return cv2_module().cvtColor(np.ascontiguousarray(rgb), cv2_module().COLOR_RGB2GRAY)
