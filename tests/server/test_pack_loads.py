"""The pack loads in a real ComfyUI and registers its nodes with descriptions and tooltips."""
import json
import os

from workflow_util import WORKFLOWS

OUR_NODES = {"SDAccelKSampler": "SD Accel/sampling", "SDAccelApply": "SD Accel/patches",
             "SDAccelVRAMPool": "SD Accel/memory", "SDAccelVAEDecode": "SD Accel/vae",
             "SDAccelVAEEncode": "SD Accel/vae", "SDAccelApplyVAE": "SD Accel/patches",
             "SDAccelCannyMap": "SD Accel/controlnet", "SDAccelDepthMap": "SD Accel/controlnet",
             "SDAccelPoseMap": "SD Accel/controlnet", "SDAccelConditionCache": "SD Accel/controlnet",
             "SDAccelSaveImage": "SD Accel/image", "SDAccelApplyCLIP": "SD Accel/patches"}


def test_pack_imported_without_errors(comfy):
    log = comfy.log_text()
    assert "ComfyUI-SD-Accel" in log, "the pack folder was not even scanned"
    bad = [ln for ln in log.splitlines() if "IMPORT FAILED" in ln and "SD-Accel" in ln]
    assert not bad, bad
    assert "[SD Accel] not loaded" not in log
    assert "[SD Accel] nodes." not in log, "a node module failed to import"


def test_nodes_registered_with_category_description_and_tooltips(comfy):
    info = comfy.object_info()
    for node, category in OUR_NODES.items():
        assert node in info, "%s missing from /object_info" % node
        spec = info[node]
        assert spec["category"] == category
        assert len(spec.get("description", "")) > 40
        for group in ("required", "optional"):
            for name, conf in spec["input"].get(group, {}).items():
                if name in ("model",) or node == "SDAccelKSampler" and name in info["KSampler"]["input"]["required"]:
                    continue   # KSampler's own inputs keep the host's own options
                assert len(conf) > 1 and conf[1].get("tooltip"), "%s.%s has no tooltip" % (node, name)


def test_accelerated_ksampler_has_all_of_ksampler_inputs(comfy):
    info = comfy.object_info()
    ks = info["KSampler"]["input"]["required"]
    ours = info["SDAccelKSampler"]["input"]["required"]
    for name, conf in ks.items():
        assert name in ours, name
        assert ours[name][0] == conf[0], name
    assert info["SDAccelKSampler"]["output"][0] == "LATENT"


def test_ui_workflows_use_only_known_node_types(comfy):
    info = comfy.object_info()
    ui_files = [f for f in os.listdir(WORKFLOWS) if f.endswith(".json") and not f.endswith(".api.json")]
    api_files = [f for f in os.listdir(WORKFLOWS) if f.endswith(".api.json")]
    assert ui_files and len(ui_files) == len(api_files), "every API workflow needs its UI twin"
    for f in ui_files:
        with open(os.path.join(WORKFLOWS, f)) as fh:
            wf = json.load(fh)
        missing = {n["type"] for n in wf["nodes"]} - set(info)
        assert not missing, "%s uses unknown node types %s" % (f, missing)
        for link in wf["links"]:
            assert len(link) == 6
