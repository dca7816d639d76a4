"""Canny preprocessor: cv2 path, the torch fallback (bit-exact with cv2), hysteresis, cache key."""
import numpy as np
import pytest
import skimage.data
import torch

from sd_accel.engine import preprocess as pp
from sd_accel.engine.preprocess.condition_cache import ConditionCache
from sd_accel.engine.preprocess import canny

cv2 = pytest.importorskip("cv2")

PHOTO = skimage.data.astronaut()  # 512x512 RGB uint8, a real photo


def _image(rgb):
    img = torch.from_numpy(rgb.astype(np.float32) / 255)
    return img if img.ndim == 4 else img[None]


def test_cv2_path_matches_plain_cv2_canny():
    pre = canny.CannyPreprocessor(100, 200)
    assert pre.implementation == "cv2"
    (edges,) = pre.compute(PHOTO[None])
    ref = cv2.Canny(cv2.cvtColor(PHOTO, cv2.COLOR_RGB2GRAY), 100, 200)
    assert edges.dtype == np.uint8 and edges.shape == (512, 512)
    assert np.array_equal(edges, ref)
    assert set(np.unique(edges)) == {0, 255}
    assert 0.02 < (edges > 0).mean() < 0.2  # a photo has edges, but it is mostly background


def test_grey_conversion_matches_cv2():
    assert np.array_equal(canny.rgb_to_gray(PHOTO), cv2.cvtColor(PHOTO, cv2.COLOR_RGB2GRAY))


@pytest.mark.parametrize("low,high,blur,l2", [(100, 200, 0, False), (100, 200, 0, True),
                                               (102, 204, 5, True), (50, 150, 3, False),
                                               (30, 90, 7, False), (200, 100, 0, False)])
def test_torch_fallback_is_bit_exact_with_cv2(low, high, blur, l2):
    gray = canny.rgb_to_gray(PHOTO)
    ref = canny.canny_cv2(gray, low, high, blur, l2)
    got = canny.canny_torch(gray, low, high, blur, l2)
    assert got.dtype == np.uint8 and got.shape == gray.shape
    assert np.array_equal(got, ref), f"{(got != ref).sum()} pixels differ"


def test_torch_blur_matches_cv2_gaussian():
    gray = canny.rgb_to_gray(PHOTO)
    for k in (3, 5, 7):
        got = canny._blur_torch(torch.from_numpy(gray).float()[None, None], k)[0, 0].numpy()
        assert np.array_equal(got.astype(np.uint8), cv2.GaussianBlur(gray, (k, k), 0))


def test_hysteresis_keeps_components_touching_a_strong_pixel():
    cand = np.zeros((8, 10), bool)
    cand[1, 1:5] = True          # component A, strong at its end
    cand[2, 5] = True            # diagonal neighbour: still A (8-connected)
    cand[5, 1:4] = True          # component B, weak only
    cand[6:8, 8] = True          # component C, strong
    strong = np.zeros_like(cand)
    strong[1, 4] = strong[7, 8] = True
    strong[0, 0] = True          # strong but not a candidate: ignored
    out = canny.hysteresis(cand, strong)
    want = cand.copy()
    want[5, 1:4] = False
    assert np.array_equal(out, want)


def test_fallback_used_without_cv2(monkeypatch):
    monkeypatch.setattr(canny, "cv2_module", lambda: None)
    pre = canny.CannyPreprocessor(100, 200)
    assert pre.implementation == "torch"
    spec = pre.spec()
    assert spec["implementation"] == "torch" and "scipy" in spec["libs"] and "cv2" not in spec["libs"]
    (edges,) = pre.compute(PHOTO[None])
    monkeypatch.undo()
    assert np.array_equal(edges, canny.CannyPreprocessor(100, 200).compute(PHOTO[None])[0])


def test_implementation_and_parameters_are_in_the_key():
    a = canny.CannyPreprocessor(100, 200, implementation="cv2").spec()
    b = canny.CannyPreprocessor(100, 200, implementation="torch").spec()
    c = canny.CannyPreprocessor(100, 201, implementation="cv2").spec()
    d = canny.CannyPreprocessor(100, 200, blur=5, implementation="cv2").spec()
    assert len({str(s) for s in (a, b, c, d)}) == 4
    assert a["libs"] == {"cv2": cv2.__version__.split(".")[0]}


def test_bad_parameters():
    with pytest.raises(ValueError, match="blur"):
        canny.CannyPreprocessor(blur=4)
    with pytest.raises(ValueError, match="implementation"):
        canny.CannyPreprocessor(implementation="kornia")


def test_run_through_cache_on_a_batch(tmp_path):
    frames = np.stack([PHOTO, PHOTO[:, ::-1]])
    img = _image(frames)
    cache = ConditionCache(str(tmp_path))
    pre = canny.CannyPreprocessor(100, 200)
    out1, r1 = pp.run(pre, img, cache)
    out2, r2 = pp.run(pre, img, cache)
    assert (r1.hits, r1.misses, r2.hits, r2.misses) == (0, 2, 2, 0)
    assert out1.shape == (2, 512, 512, 3) and out1.dtype == torch.float32
    assert torch.equal(out1, out2)
    assert torch.equal(out1[..., 0], out1[..., 2])
    ref = cv2.Canny(cv2.cvtColor(PHOTO, cv2.COLOR_RGB2GRAY), 100, 200)
    assert torch.equal(out1[0, ..., 0], torch.from_numpy(ref).float() / 255)
    assert len(list(tmp_path.glob("*.pt"))) == 2
