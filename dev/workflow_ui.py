#!/usr/bin/env python3
"""Writes the UI-format twin (drag-and-drop into ComfyUI) of an API-format workflow.

The widget order comes from a live server's /object_info, so the file matches what the frontend builds:
  python dev/workflow_ui.py --server http://127.0.0.1:8188 workflows/X.api.json  ->  workflows/X.json
Seed-like INT inputs get the frontend's extra "control_after_generate" widget value ("fixed").
The workflow's title and description live in the twin (`extra.sd_accel`) and are kept when it is rewritten:
an API file holds nodes only, since ComfyUI refuses a prompt with any other top-level key.
"""
import argparse
import json
import os
import urllib.request

SEED_NAMES = ("seed", "noise_seed")


def _is_link(v):
    return isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)


def api_to_ui(api, info, meta=None):
    nodes, links = [], []
    ids = {k: i + 1 for i, k in enumerate(api)}
    out_links = {}
    order = sorted(ids, key=lambda k: _depth(api, k))
    col_y = {}
    for k in order:
        node = api[k]
        spec = info[node["class_type"]]
        req = spec["input"].get("required", {})
        opt = spec["input"].get("optional", {})
        inputs, widgets = [], []
        for name, conf in list(req.items()) + list(opt.items()):
            typ = conf[0]
            v = node["inputs"].get(name)
            is_widget = isinstance(typ, list) or typ in ("INT", "FLOAT", "STRING", "BOOLEAN")
            if _is_link(v):
                lid = len(links) + 1
                src = ids[v[0]]
                links.append([lid, src, v[1], ids[k], len(inputs), typ if isinstance(typ, str) else "COMBO"])
                out_links.setdefault((src, v[1]), []).append(lid)
                entry = {"name": name, "type": typ if isinstance(typ, str) else "COMBO", "link": lid}
                if is_widget:
                    entry["widget"] = {"name": name}
                inputs.append(entry)
            elif is_widget:
                widgets.append(v if v is not None else conf[1].get("default") if len(conf) > 1 else None)
                if name in SEED_NAMES:
                    widgets.append("fixed")
        d = _depth(api, k)
        y = col_y.get(d, 0)
        col_y[d] = y + 260
        nodes.append({"id": ids[k], "type": node["class_type"], "pos": [60 + 380 * d, 60 + y],
                      "size": [340, 220], "flags": {}, "order": len(nodes), "mode": 0,
                      "inputs": inputs, "outputs": [], "properties": {"Node name for S&R": node["class_type"]},
                      "widgets_values": widgets,
                      **({"title": node["_meta"]["title"]} if "_meta" in node else {})})
    by_id = {n["id"]: n for n in nodes}
    for n in nodes:
        spec = info[n["type"]]
        for slot, typ in enumerate(spec["output"]):
            n["outputs"].append({"name": spec.get("output_name", spec["output"])[slot], "type": typ,
                                 "links": out_links.get((n["id"], slot), []), "slot_index": slot})
    return {"last_node_id": max(by_id), "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"sd_accel": meta or {}}, "version": 0.4}


def _depth(api, k, seen=()):
    ins = [v[0] for v in api[k]["inputs"].values() if _is_link(v)]
    return 0 if not ins else 1 + max(_depth(api, i, seen + (k,)) for i in ins if i not in seen)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("api_files", nargs="+")
    a = ap.parse_args()
    info = json.load(urllib.request.urlopen(a.server + "/object_info"))
    for path in a.api_files:
        api = json.load(open(path))
        out = path.replace(".api.json", ".json")
        meta = {}
        if os.path.exists(out):
            with open(out) as f:
                meta = json.load(f).get("extra", {}).get("sd_accel", {})
        with open(out, "w") as f:
            json.dump(api_to_ui(api, info, meta), f, indent=1)
        print("wrote", out)


if __name__ == "__main__":
    main()
