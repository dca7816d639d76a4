"""Make the template-browser thumbnails: workflows/<name>.jpg for each UI workflow workflows/<name>.json.

    python tests/browser/make_thumbnails.py            # only the missing ones
    python tests/browser/make_thumbnails.py --force    # all of them

Starts the test harness's ComfyUI ($SDACCEL_COMFYUI, else the 2024 copy of dev/setup_env.sh), opens each
workflow in headless Chromium, frames its SD Accel nodes (the whole graph when it has none; a whole graph
is illegible at card size) and saves a small square JPEG: the template browser looks for <name>.jpg next
to <name>.json. The shipped ones were made with the current ComfyUI (its frontend is the one that shows
them). Needs what the browser tests need: dev/setup_env.sh and dev/setup_chromium.sh.
"""
import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import browser_util  # noqa: E402
from browser_util import WORKFLOWS, load_json, ui_workflows  # noqa: E402
import comfy_server  # noqa: E402  (on sys.path through browser_util)

HOME = os.environ.get("SDACCEL_HOME", os.path.expanduser("~/.cache/sd_accel"))
COMFY = os.environ.get("SDACCEL_COMFYUI") or os.path.join(HOME, "ComfyUI-2024")


def square_jpeg(png_path, out_path, size, quality=82):
    from PIL import Image
    with Image.open(png_path) as im:
        im = im.convert("RGB")
        side = max(im.size)
        bg = Image.new("RGB", (side, side), im.getpixel((1, 1)))
        bg.paste(im, ((side - im.size[0]) // 2, (side - im.size[1]) // 2))
        bg.resize((size, size), Image.LANCZOS).save(out_path, "JPEG", quality=quality, optimize=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="remake existing thumbnails too")
    ap.add_argument("--size", type=int, default=400, help="side of the square thumbnail in pixels")
    args = ap.parse_args()
    todo = {n: p for n, p in ui_workflows(WORKFLOWS).items()
            if args.force or not os.path.exists(os.path.join(WORKFLOWS, n + ".jpg"))}
    if not todo:
        print("all thumbnails present (use --force to remake them)")
        return 0
    from playwright.sync_api import sync_playwright
    work = tempfile.mkdtemp(prefix="sdaccel_thumbs_")
    with comfy_server.ComfyServer(COMFY, sys.executable, work, os.path.join(HOME, "models")) as srv, \
            sync_playwright() as p:
        ctx = browser_util.launch(p)
        ui = browser_util.ComfyPage(ctx, srv.url).open()
        for name, path in todo.items():
            missing = ui.load_workflow(load_json(path))
            if missing:
                print("%s: unknown node types %s (drawn as placeholders)" % (name, missing))
            ours = [n["id"] for n in ui.graph_nodes() if n["type"].startswith("SDAccel")]
            clip = ui.frame(ours or None, margin=70, max_scale=1.5)
            shot = ui.screenshot(os.path.join(work, name + ".png"), clip)
            out = os.path.join(WORKFLOWS, name + ".jpg")
            square_jpeg(shot, out, args.size)
            print("wrote %s (%d bytes)" % (out, os.path.getsize(out)))
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
