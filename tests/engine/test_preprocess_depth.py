"""Depth preprocessor with tiny random transformers models (Depth Anything V2 and DPT layouts)."""
import os
import types

import numpy as np
import pytest
import skimage.data
import torch

from sd_accel.engine import preprocess as pp
from sd_accel.engine.preprocess.condition_cache import ConditionCache
from sd_accel.engine.preprocess import depth

pytest.importorskip("transformers")
from tiny_models import make_tiny_depth_model  # noqa: E402

PHOTO = skimage.data.astronaut()


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth_models")
    make_tiny_depth_model(str(root / "tiny-da2"), kind="depth_anything")
    make_tiny_depth_model(str(root / "tiny-dpt"), kind="dpt", size=128)
    return str(root)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("name", ["tiny-da2", "tiny-dpt"])
def test_depth_on_a_photo(models_dir, name):
    pre = depth.DepthPreprocessor(name, search_dirs=[models_dir])
    (m,) = pre.compute(PHOTO[None])
    assert m.dtype == np.uint8 and m.shape == (512, 512)
    assert m.min() == 0 and m.max() == 255  # per-image min-max
    assert len(np.unique(m)) > 50  # a real map, not a constant


def test_absolute_path_and_listing(models_dir):
    path = os.path.join(models_dir, "tiny-da2")
    pre = depth.DepthPreprocessor(path)
    assert pre.path == path
    assert depth.list_depth_models([models_dir]) == ["tiny-da2", "tiny-dpt"]


def test_spec_has_weights_identity_and_libs(models_dir):
    pre = depth.DepthPreprocessor("tiny-da2", search_dirs=[models_dir])
    spec = pre.spec()
    names = [f[0] for f in spec["weights"]["files"]]
    assert names == ["config.json", "model.safetensors", "preprocessor_config.json"]
    assert spec["libs"]["transformers"] == __import__("transformers").__version__.split(".")[0]
    assert spec["params"] == {"resolution": 0, "dtype": "float32"}
    assert depth.DepthPreprocessor("tiny-da2", search_dirs=[models_dir], resolution=70).spec() != spec


def test_cached_run_is_identical_and_never_loads_the_model(models_dir, tmp_path, monkeypatch):
    img = torch.from_numpy(PHOTO.astype(np.float32) / 255)[None]
    cache = ConditionCache(str(tmp_path))
    pre = depth.DepthPreprocessor("tiny-da2", search_dirs=[models_dir])
    out1, r1 = pp.run(pre, img, cache)
    monkeypatch.setattr(depth, "_load", lambda *a, **k: pytest.fail("model loaded on a cache hit"))
    out2, r2 = pp.run(depth.DepthPreprocessor("tiny-da2", search_dirs=[models_dir]), img, cache)
    assert (r1.misses, r2.hits) == (1, 1)
    assert torch.equal(out1, out2)
    assert out1.shape == (1, 512, 512, 3) and torch.equal(out1[..., 0], out1[..., 1])
    assert float(out1.min()) == 0.0 and float(out1.max()) == 1.0


def test_changed_weights_miss(models_dir, tmp_path):
    img = torch.from_numpy(PHOTO[::4, ::4].astype(np.float32) / 255)[None]
    cache = ConditionCache(str(tmp_path))
    pp.run(depth.DepthPreprocessor("tiny-dpt", search_dirs=[models_dir]), img, cache)
    cfg = os.path.join(models_dir, "tiny-dpt", "config.json")
    st = os.stat(cfg)
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    _, r = pp.run(depth.DepthPreprocessor("tiny-dpt", search_dirs=[models_dir]), img, cache)
    assert r.misses == 1


def test_near_is_bright_and_metric_models_are_inverted():
    ramp = torch.linspace(0, 5, 16).repeat(8, 1)  # value grows to the right
    rel = depth.depth_to_u8(ramp, (8, 16), metric=False)
    met = depth.depth_to_u8(ramp, (8, 16), metric=True)
    assert rel[0, 0] == 0 and rel[0, -1] == 255  # inverse depth: large = near = bright
    assert met[0, 0] == 255 and met[0, -1] == 0  # distance: large = far = dark
    assert np.array_equal(depth.depth_to_u8(torch.ones(4, 4), (4, 4), False), np.zeros((4, 4), np.uint8))
    ns = types.SimpleNamespace
    assert not depth.is_metric(ns(model_type="depth_anything", depth_estimation_type="relative"))
    assert depth.is_metric(ns(model_type="depth_anything", depth_estimation_type="metric"))
    assert not depth.is_metric(ns(model_type="dpt"))
    assert depth.is_metric(ns(model_type="zoedepth"))


def test_missing_weights_message_names_files_and_folder(tmp_path):
    with pytest.raises(pp.MissingWeightsError) as e:
        depth.DepthPreprocessor("Depth-Anything-V2-Small-hf", search_dirs=[str(tmp_path)])
    msg = str(e.value)
    for f in ("config.json", "model.safetensors", "preprocessor_config.json"):
        assert f in msg
    assert os.path.join(str(tmp_path), "Depth-Anything-V2-Small-hf") in msg
    assert "downloaded" in msg
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(pp.MissingWeightsError):
        depth.DepthPreprocessor("half", search_dirs=[str(tmp_path)])
