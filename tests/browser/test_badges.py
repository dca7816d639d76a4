"""Run badges: after a prompt, the pack's nodes show what their UI output said, and what they show
matches the server's /history entry for that prompt (the same data, and the numbers as drawn).

Prompts are queued from the page through the frontend's own client, so the "executed" messages reach
the page's websocket exactly as in use."""
import json
import os
import random
import re

from browser_util import WORKFLOWS, load_json, ui_workflows

TXT2IMG = "sd15_txt2img_accelerated"
HEAD = re.compile(r"^(?P<it_s>[\d.]+|–) it/s · (?P<seconds>[\d.]+|–) s · "
                  r"(?:VRAM n/a \(CPU\)|(?P<vram>[\d.]+) GiB peak VRAM)$")
CACHE_HEAD = re.compile(r"^cache: (?P<hits>\d+) hits?, (?P<misses>\d+) miss(?:es)? · (?P<seconds>[\d.]+) s$")


def _close(drawn, value, digits=2):
    """A number drawn with `digits` decimals is `value` rounded (either way on an exact tie)."""
    return abs(float(drawn) - value) <= 0.5 * 10 ** -digits + 1e-9


def _format_bytes(n):   # the badge's formatBytes
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024.0
        i += 1
    return "%d B" % n if i == 0 else "%.1f %s" % (n, units[i])


def squeeze(text):   # the badge wraps lines where it likes
    return re.sub(r"\s+", "", text)


def _joined(lines):
    return " ".join(lines)


def _check_report_badge(badge, report, detail):
    lines = badge["lines"]
    head = HEAD.match(lines[0])
    assert head, lines
    if report["it_s"] is not None:
        assert _close(head["it_s"], report["it_s"]), (lines[0], report)
    assert _close(head["seconds"], report["seconds"]), (lines[0], report)
    if report["peak_vram_gib"] is None:
        assert head["vram"] is None and "n/a (CPU)" in lines[0]
    else:
        assert _close(head["vram"], report["peak_vram_gib"]), (lines[0], report)
    text = _joined(lines[1:])
    for item in report["ran"]:
        assert item in text, (item, lines)
    if not report["ran"]:
        assert "stock path only" in text, lines
    for what, why in report["fell_back"].items():
        assert what in text, (what, lines)
        if detail == "full" and why != "off":
            assert ("✗ %s: %s" % (what, why))[:40] in text, (what, why, lines)


def _txt2img_with_apply(ui, models, fused):
    """The shipped txt2img template at test size, with Apply SD Accel inserted before the sampler."""
    missing = ui.load_workflow(load_json(ui_workflows(WORKFLOWS)[TXT2IMG]))
    assert not missing, missing
    one = lambda t: ui.nodes_of_type(t)[0]   # noqa: E731
    loader, latent, ks = one("CheckpointLoaderSimple"), one("EmptyLatentImage"), one("SDAccelKSampler")
    ui.set_widgets(loader["id"], {"ckpt_name": models["sd15"]})
    ui.set_widgets(latent["id"], {"width": 64, "height": 64, "batch_size": 1})
    ui.set_widgets(ks["id"], {"steps": 2, "fused_kernels": fused, "cuda_graph": True, "channels_last": True})
    apply_id = ui.add_node("SDAccelApply", {"fused_kernels": fused, "cuda_graph": False, "channels_last": False},
                           pos=(loader["pos"][0], latent["pos"][1] + latent["size"][1] + 60))
    ui.connect(loader["id"], 0, apply_id, 0)
    ui.connect(apply_id, 0, ks["id"], 0)
    return ks["id"], apply_id


# Fused kernels run through Triton's interpreter on a CPU-only machine: about a minute a prompt, more on a
# busy machine. Off by default here (the badge then reports the stock path and why); SDACCEL_BROWSER_FUSED=1
# turns them on, so the badge lists the fused ops that really ran.
FUSED = os.environ.get("SDACCEL_BROWSER_FUSED") == "1"


def test_sampler_and_apply_badges_match_history(ui, comfy, models, artifacts):
    ks_id, apply_id = _txt2img_with_apply(ui, models, fused=FUSED)
    since = ui.page_time()
    prompt_id = ui.queue()
    badge = ui.wait_badge(ks_id, since, timeout=540)
    apply_badge = ui.wait_badge(apply_id, since, timeout=30)
    entry = comfy.wait(prompt_id)
    assert entry["status"]["status_str"] == "success", entry["status"]
    out = entry["outputs"]
    report = out[str(ks_id)]["sdaccel_report"][-1]
    assert badge["output"]["sdaccel_report"][-1] == report         # the page got what /history holds
    if FUSED:
        assert report["ran"], "fused kernels should have run: %s" % json.dumps(report)
    else:
        assert report["fell_back"].get("fused_kernels") == "off", report
    _check_report_badge(badge, report, "compact")
    assert squeeze("".join(apply_badge["lines"])) == squeeze(out[str(apply_id)]["text"][0])
    clip = ui.frame([ks_id, apply_id])
    ui.screenshot(os.path.join(artifacts, "badge_compact.png"), clip)

    try:
        height = ui.node_height(ks_id)
        ui.set_setting("SDAccel.BadgeDetail", "full")
        full = ui.wait_redraw(ks_id)
        _check_report_badge(full, report, "full")
        assert len(full["lines"]) >= len(badge["lines"])
        clip = ui.frame([ks_id])
        ui.screenshot(os.path.join(artifacts, "badge_full.png"), clip)

        ui.set_setting("SDAccel.ShowBadges", False)
        ui.evaluate("() => app.canvas.draw(true, true)")
        draws = ui.badge(ks_id)["draws"]
        ui.evaluate("() => app.canvas.draw(true, true)")
        assert ui.badge(ks_id)["draws"] == draws, "badge still drawn with SDAccel.ShowBadges off"
        assert ui.node_height(ks_id) < height
    finally:
        ui.set_setting("SDAccel.BadgeDetail", "compact")
        ui.set_setting("SDAccel.ShowBadges", True)
    assert not ui.unexpected_errors(), "\n".join(ui.unexpected_errors())


def test_condition_map_badges_show_cache_hits_misses_and_size(ui, comfy, artifacts):
    # Two Canny nodes on the same image: the first to run computes and stores the map (a miss), the
    # other finds it (a hit). ComfyUI would reuse the first node's output for a second node with the
    # same inputs instead of running it, so the second gets the image through RepeatImageBatch(1) (the
    # same pixels, other inputs). A random colour keeps earlier runs' cache entries out.
    ui.clear_graph()
    img = ui.add_node("EmptyImage", {"width": 64, "height": 64, "batch_size": 1,
                                     "color": random.randrange(1, 0xFFFFFF)}, pos=(40, 40))
    rep = ui.add_node("RepeatImageBatch", {"amount": 1}, pos=(40, 340))
    ui.connect(img, 0, rep, 0)
    canny = []
    for row, src in enumerate((img, rep)):
        c = ui.add_node("SDAccelCannyMap", pos=(400, 40 + 300 * row))
        prev = ui.add_node("PreviewImage", pos=(760, 40 + 300 * row))
        ui.connect(src, 0, c, 0)
        ui.connect(c, 0, prev, 0)
        canny.append(c)
    stats = ui.add_node("SDAccelConditionCache", pos=(400, 640))
    ui.set_widgets(stats, {"max_size_mb": 0, "clear": False})
    since = ui.page_time()
    prompt_id = ui.queue()
    badges = [ui.wait_badge(c, since, timeout=120) for c in canny]
    stats_badge = ui.wait_badge(stats, since, timeout=60)
    entry = comfy.wait(prompt_id)
    assert entry["status"]["status_str"] == "success", entry["status"]
    seen = {"hits": 0, "misses": 0}
    for c, badge in zip(canny, badges):
        cache = entry["outputs"][str(c)]["sdaccel_cache"][-1]
        assert badge["output"]["sdaccel_cache"][-1] == cache
        head = CACHE_HEAD.match(badge["lines"][0])
        assert head, badge["lines"]
        assert int(head["hits"]) == cache["hits"] and int(head["misses"]) == cache["misses"]
        assert _close(head["seconds"], cache["seconds"])
        assert badge["lines"][1] == "cache size on disk: %s" % _format_bytes(cache["cache_bytes"])
        seen["hits"] += cache["hits"]
        seen["misses"] += cache["misses"]
    assert seen == {"hits": 1, "misses": 1}, seen
    text = entry["outputs"][str(stats)]["text"][0]
    assert squeeze("".join(stats_badge["lines"])) == squeeze(text), (stats_badge["lines"], text)
    clip = ui.frame(canny + [stats])
    ui.screenshot(os.path.join(artifacts, "badge_condition_cache.png"), clip)
    assert not ui.unexpected_errors(), "\n".join(ui.unexpected_errors())


# A report as Accelerated KSampler sends it on a GPU: recorded on an H200 (bench/results.jsonl, config
# sd15_512_b1, 20 steps; seconds = steps / it/s). It is fed through node.onExecuted, the entry point the
# frontend calls for an "executed" message: this machine has no GPU, so no real run here shows VRAM.
GPU_REPORT = {"it_s": 64.75, "seconds": 0.3089, "steps": 20, "peak_vram_gib": 2.192,
              "ran": ["geglu x32", "group_norm x32", "group_norm_silu x90", "layer_norm x96",
                      "cuda_graph (19 replays, 1 captures)"],
              "fell_back": {}, "graphs": {"captures": 1, "replays": 19, "eager": 1, "invalidations": 0},
              "notes": []}
# The same with a fallback, an option turned off and a note, so that every kind of row is drawn.
GPU_REPORT_MIXED = dict(GPU_REPORT, fell_back={"layer_norm": "non-contiguous input", "channels_last": "off"},
                        notes=["layout test note"])


# The same sampled through a VRAM Pool with its clip output used: the pool's stages ride in "memory" (the
# sampling peak is run 40's SDXL at 4 GiB; the text encode's a stand-in: the bench encodes with stock's CLIP).
GPU_REPORT_POOL = dict(GPU_REPORT, memory={"stages": [
    {"stage": "text encode", "peak_allocated": int(0.54 * 2 ** 30), "peak_reserved": int(0.6 * 2 ** 30),
     "fragmentation": 1.11, "reason": None, "error": None},
    {"stage": "sampling", "peak_allocated": int(3.93 * 2 ** 30), "peak_reserved": int(4.1 * 2 ** 30),
     "fragmentation": 1.04, "reason": None, "error": None}]})


def _feed(ui, node_id, report):
    ui.evaluate("([id, r]) => app.graph.getNodeById(id).onExecuted({sdaccel_report: [r], text: ['x']})",
                [node_id, report])
    return ui.wait_redraw(node_id)


def test_badge_layout_of_gpu_reports(ui, artifacts):
    ui.clear_graph()
    ks = ui.add_node("SDAccelKSampler", pos=(100, 100))
    try:
        badge = _feed(ui, ks, GPU_REPORT)
        assert badge["lines"][0] == "64.75 it/s · 0.31 s · 2.19 GiB peak VRAM", badge["lines"]
        assert badge["lines"][1].startswith("ran: geglu x32, group_norm x32"), badge["lines"]
        _check_report_badge(badge, GPU_REPORT, "compact")
        assert not any(ln.startswith(("fell back", "off:")) for ln in badge["lines"]), badge["lines"]
        ui.screenshot(os.path.join(artifacts, "badge_gpu_report.png"), ui.frame([ks], max_scale=1.5))

        pooled = _feed(ui, ks, GPU_REPORT_POOL)
        _check_report_badge(pooled, GPU_REPORT_POOL, "compact")
        assert squeeze("VRAM Pool peaks: text encode 0.54 GiB · sampling 3.93 GiB") in squeeze(
            _joined(pooled["lines"])), pooled["lines"]

        mixed = _feed(ui, ks, GPU_REPORT_MIXED)
        _check_report_badge(mixed, GPU_REPORT_MIXED, "compact")
        assert "fell back: layer_norm" in mixed["lines"] and "off: channels_last" in mixed["lines"], mixed["lines"]
        assert any(ln.startswith("1 note") for ln in mixed["lines"]), mixed["lines"]
        ui.set_setting("SDAccel.BadgeDetail", "full")
        full = ui.wait_redraw(ks)
        _check_report_badge(full, GPU_REPORT_MIXED, "full")
        assert "✓ group_norm_silu x90" in full["lines"] and "• layout test note" in full["lines"], full["lines"]
        ui.screenshot(os.path.join(artifacts, "badge_gpu_report_full.png"), ui.frame([ks], max_scale=1.5))
    finally:
        ui.set_setting("SDAccel.BadgeDetail", "compact")
    assert not ui.unexpected_errors(), "\n".join(ui.unexpected_errors())
