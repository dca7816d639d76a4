"""ControlNet condition-map nodes called directly, without a ComfyUI server (folder_paths absent or faked)."""
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import skimage.data
import torch

from sd_accel.engine.preprocess import condition_cache as cc
from sd_accel.engine import preprocess as pp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHOTO = torch.from_numpy(skimage.data.astronaut()[::2, ::2].astype(np.float32) / 255)[None]  # 256x256


@pytest.fixture(scope="module")
def cn():
    """The node module, imported when the tests run rather than at collection: importing the `nodes`
    package pulls in the other node modules (and Triton), which must not happen before other test
    modules have set up their environment."""
    import importlib
    return importlib.import_module("sd_accel.nodes.controlnet_nodes")


@pytest.fixture(autouse=True)
def no_comfy(monkeypatch, tmp_path):
    """No ComfyUI modules; a fresh cache folder per test through the env override."""
    monkeypatch.setitem(sys.modules, "folder_paths", None)
    monkeypatch.setitem(sys.modules, "comfy", None)
    monkeypatch.setenv(cc.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv("AUX_ANNOTATOR_CKPTS_PATH", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _fake_folder_paths(root):
    fp = types.ModuleType("folder_paths")
    fp.models_dir = str(root / "models")
    fp.folder_names_and_paths = {"custom_nodes": ([str(root / "custom_nodes")], set())}

    def get_folder_paths(kind):
        return list(fp.folder_names_and_paths[kind][0])

    def add_model_folder_path(kind, path, is_default=False):
        paths = fp.folder_names_and_paths.setdefault(kind, ([], set()))[0]
        if path not in paths:
            paths.insert(0, path) if is_default else paths.append(path)

    fp.get_folder_paths = get_folder_paths
    fp.add_model_folder_path = add_model_folder_path
    fp.get_user_directory = lambda: str(root / "user")
    return fp


def test_module_imports_without_comfyui():
    code = ("import sys, types; pkg = types.ModuleType('sd_accel'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['sd_accel'] = pkg; import sd_accel.nodes.controlnet_nodes as m; "
            "assert 'folder_paths' not in sys.modules and 'comfy' not in sys.modules; "
            "print(sorted(m.NODE_CLASS_MAPPINGS))")
    out = subprocess.run([sys.executable, "-c", code, REPO], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SDAccelConditionCache" in out.stdout


def test_every_node_has_description_category_and_tooltips(cn):
    assert set(cn.NODE_CLASS_MAPPINGS) == set(cn.NODE_DISPLAY_NAME_MAPPINGS) == {
        "SDAccelCannyMap", "SDAccelDepthMap", "SDAccelPoseMap", "SDAccelConditionCache"}
    for node_id, cls in cn.NODE_CLASS_MAPPINGS.items():
        assert node_id.startswith("SDAccel")
        assert cls.CATEGORY == "SD Accel/controlnet"
        assert len(cls.DESCRIPTION) > 40
        assert callable(getattr(cls(), cls.FUNCTION))
        assert len(cls.OUTPUT_TOOLTIPS) == len(cls.RETURN_TYPES)
        spec = cls.INPUT_TYPES()
        for group in spec.values():
            for name, (kind, opts) in group.items():
                assert opts.get("tooltip"), f"{node_id}.{name} has no tooltip"
                if isinstance(kind, list):
                    assert opts["default"] in kind
    for cls in (cn.SDAccelCannyMap, cn.SDAccelDepthMap, cn.SDAccelPoseMap):
        assert cls.RETURN_TYPES == ("IMAGE",) and "use_cache" in cls.INPUT_TYPES()["required"]


def _check_result(res, shape):
    (img,) = res["result"]
    assert img.shape == shape and img.dtype == torch.float32
    assert float(img.min()) >= 0.0 and float(img.max()) <= 1.0
    (ui,) = res["ui"]["sdaccel_cache"]
    assert set(ui) == {"hits", "misses", "seconds", "cache_bytes"}
    return img, ui


def test_canny_node_caches_across_runs(cn, tmp_path):
    node = cn.SDAccelCannyMap()
    img1, ui1 = _check_result(node.execute(PHOTO, 100, 200, "0", False, True), (1, 256, 256, 3))
    img2, ui2 = _check_result(node.execute(PHOTO, 100, 200, "0", False, True), (1, 256, 256, 3))
    assert (ui1["hits"], ui1["misses"], ui2["hits"], ui2["misses"]) == (0, 1, 1, 0)
    assert torch.equal(img1, img2) and ui2["cache_bytes"] > 0
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 1
    _, ui3 = _check_result(node.execute(PHOTO, 100, 200, "5", False, True), (1, 256, 256, 3))
    assert ui3["misses"] == 1


def test_use_cache_off_writes_nothing(cn, tmp_path):
    img, ui = _check_result(cn.SDAccelCannyMap().execute(PHOTO, use_cache=False), (1, 256, 256, 3))
    assert (ui["hits"], ui["misses"], ui["cache_bytes"]) == (0, 1, 0)
    assert not (tmp_path / "cache").exists()


def test_depth_node_with_an_absolute_model_path(cn, tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import make_tiny_depth_model
    model = make_tiny_depth_model(str(tmp_path / "tiny-da2"))
    node = cn.SDAccelDepthMap()
    img, ui = _check_result(node.execute(PHOTO, model_path=model), (1, 256, 256, 3))
    assert ui["misses"] == 1 and float(img.max()) == 1.0
    img2, ui2 = _check_result(node.execute(PHOTO, model_path=model), (1, 256, 256, 3))
    assert ui2["hits"] == 1 and torch.equal(img, img2)


def test_depth_node_missing_weights_message(cn):
    with pytest.raises(pp.MissingWeightsError, match="config.json.*model.safetensors"):
        cn.SDAccelDepthMap().execute(PHOTO, model="Depth-Anything-V2-Small-hf")


def test_with_folder_paths_registers_model_kinds_and_uses_the_user_dir(cn, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    from tiny_models import make_tiny_depth_model, make_tiny_pose_models
    fp = _fake_folder_paths(tmp_path)
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    monkeypatch.delenv(cc.ENV_DIR)
    make_tiny_depth_model(str(tmp_path / "models" / "depth" / "tiny"))
    make_tiny_pose_models(str(tmp_path / "custom_nodes" / "comfyui_controlnet_aux" / "ckpts" / "yzd-v" / "DWPose"))

    depth_inputs = cn.SDAccelDepthMap.INPUT_TYPES()["required"]
    assert fp.get_folder_paths("depth") == [str(tmp_path / "models" / "depth")]
    assert depth_inputs["model"][0] == ["Depth-Anything-V2-Small-hf", "tiny"]
    pose_inputs = cn.SDAccelPoseMap.INPUT_TYPES()["required"]
    assert pose_inputs["pose_model"][0] == ["dw-ll_ucoco_384.onnx"]  # found in the aux ckpts layout
    assert fp.get_folder_paths("pose") == [str(tmp_path / "models" / "pose")]
    from sd_accel.hosts.comfyui import condition_maps
    assert cc.default_cache_dir(fp.get_user_directory()) == condition_maps.cache_directory()
    assert condition_maps.cache_directory() == str(tmp_path / "user" / "sd_accel" / "condition_cache")

    _check_result(cn.SDAccelDepthMap().execute(PHOTO, model="tiny"), (1, 256, 256, 3))
    img, ui = _check_result(cn.SDAccelPoseMap().execute(PHOTO), (1, 256, 256, 3))
    assert ui["misses"] == 1 and img.any()
    assert len(list((tmp_path / "user" / "sd_accel" / "condition_cache").glob("*.pt"))) == 2


def test_pose_node_with_aux_env_and_batch(cn, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    from tiny_models import make_tiny_pose_models
    make_tiny_pose_models(str(tmp_path / "ckpts" / "yzd-v" / "DWPose"))
    monkeypatch.setenv("AUX_ANNOTATOR_CKPTS_PATH", str(tmp_path / "ckpts"))
    batch = torch.cat([PHOTO, PHOTO.flip(2), PHOTO])  # frames 0 and 2 are identical
    node = cn.SDAccelPoseMap()
    img, ui = _check_result(node.execute(batch), (3, 256, 256, 3))
    assert ui["misses"] + ui["hits"] == 3 and ui["misses"] >= 2
    assert torch.equal(img[0], img[2])
    img2, ui2 = _check_result(node.execute(batch), (3, 256, 256, 3))
    assert (ui2["hits"], ui2["misses"]) == (3, 0) and torch.equal(img, img2)
    assert "yolox_l.onnx" in cn.SDAccelPoseMap.INPUT_TYPES()["required"]["detector"][0]


def test_pose_node_missing_weights_names_files_and_folder(cn, tmp_path):
    pytest.importorskip("onnxruntime")
    with pytest.raises(pp.MissingWeightsError) as e:
        cn.SDAccelPoseMap().execute(PHOTO)
    assert "yolox_l.onnx" in str(e.value) and "dw-ll_ucoco_384.onnx" in str(e.value)


def test_cache_node_reports_and_clears(cn, tmp_path):
    canny = cn.SDAccelCannyMap()
    canny.execute(PHOTO)
    canny.execute(PHOTO)
    canny.execute(PHOTO.flip(1))
    node = cn.SDAccelConditionCache()
    assert node.IS_CHANGED(clear=False, max_size_mb=0) != node.IS_CHANGED(clear=False, max_size_mb=0)
    res = node.execute(clear=False, max_size_mb=0)
    (text,) = res["ui"]["text"]
    assert res["result"] == (text,)
    assert str(tmp_path / "cache") in text and "2 entries" in text and "1 hits, 2 misses" in text
    res = node.execute(clear=True, max_size_mb=512)
    (text,) = res["ui"]["text"]
    assert "0 entries" in text and "cleared 2 entries" in text and "cap set to 512 MiB" in text
    assert __import__("sd_accel.hosts.comfyui.condition_maps", fromlist=["get_cache"]).get_cache().max_bytes == 512 * 1024 ** 2
    assert not list((tmp_path / "cache").glob("*.pt"))
