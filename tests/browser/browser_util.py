"""Drive ComfyUI's real frontend in headless Chromium (Playwright), for the browser tests and
make_thumbnails.py. Works on both frontends: the 2024 one bundled in ComfyUI's web/ folder and the
current Vue one (comfyui-frontend-package). Everything goes through what a user's browser has: the page's
`app`, its `api` module and the DOM."""
import json
import os
import re
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKFLOWS = os.path.join(REPO, "workflows")
if os.path.join(REPO, "dev") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "dev"))
from comfy_server import PACK_DIR_NAME  # noqa: E402,F401  (the custom_nodes folder the harness links us as)

CHROMIUM = os.environ.get("SDACCEL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
VIEWPORT = {"width": 1400, "height": 900}
# floating panels that would cover framed nodes in pictures: the 2024 menu; the current frontend's minimap
# and zoom buttons
OVERLAYS = [".comfy-menu", ".minimap-main-container", ".graph-canvas-panel .p-buttongroup"]
OUR_EXTENSIONS = ("SDAccel.Badges", "SDAccel.Templates")

# Console errors that are not ours and say nothing about the pack: (message regex, resource URL regex).
# A fresh, offline ComfyUI has no per-user files yet and cannot reach the internet.
NETWORK_NOISE = [
    (r"^Failed to load resource", r"/(api/)?userdata(/|\?)"),   # user.css, workflows/, subgraphs/, comfy.templates.json
    (r"^Failed to load resource", r"/user\.css$"),               # optional user stylesheet
    (r"^Failed to load resource", r"/favicon\.ico$"),            # ComfyUI serves none
    (r"^Failed to load resource", r"^https?://(?!127\.0\.0\.1[:/]|localhost[:/])"),  # off-machine hosts
                                                                 # (api.comfy.org release notes): offline
]
# Uncaught errors of the frontend itself, identified by message and by a stack that runs through none
# of the extensions' files: (message regex, regex the stack must match).
KNOWN_FRONTEND_BUGS = [
    # frontend 1.27.10: the core setting Comfy.Canvas.NavigationMode's onChange sets
    # Comfy.Canvas.LeftMouseClickBehavior before that setting is registered (settingStore.addSetting)
    (r"Cannot read properties of undefined \(reading 'id'\)", r"addSetting"),
]


def chromium_missing():
    """Why the browser cannot start here, in one line a user can act on; None when it can."""
    if os.access(CHROMIUM, os.X_OK):
        return None
    return ("no Chromium at %s: dev/setup_chromium.sh installs it with apt-get as root (its [setup] line "
            "says why it could not); or install Chromium yourself, or set SDACCEL_CHROMIUM" % CHROMIUM)


def launch(playwright, user_data_dir=None):
    """A persistent Chromium context with a fresh profile (Debian's Chromium; no `playwright install`)."""
    missing = chromium_missing()
    if missing:
        raise RuntimeError(missing)
    return playwright.chromium.launch_persistent_context(
        user_data_dir or tempfile.mkdtemp(prefix="sdaccel_chromium_"), executable_path=CHROMIUM,
        headless=True, args=CHROMIUM_ARGS, viewport=VIEWPORT)


class ComfyPage:
    """One browser tab on a ComfyUI server, with its console errors collected from the start."""

    def __init__(self, context, url):
        self.url = url
        self.page = context.new_page()
        self.console_errors = []   # (text, url of the resource or script)
        self.page_errors = []      # (message, stack)
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda e: self.page_errors.append((str(e), getattr(e, "stack", "") or "")))

    def _on_console(self, msg):
        if msg.type == "error":
            self.console_errors.append((msg.text, (msg.location or {}).get("url", "")))

    # -- life cycle ---------------------------------------------------------------------------
    def open(self, timeout=90):
        self.page.goto(self.url)
        self.wait_ready(timeout)
        return self

    def reload(self, timeout=90):
        self.page.reload()
        self.wait_ready(timeout)

    def wait_ready(self, timeout=90):
        self.page.wait_for_function(
            """(exts) => !!(window.app && window.app.graph && window.app.canvas && window.LiteGraph
                  && LiteGraph.registered_node_types["SDAccelKSampler"]
                  && exts.every((x) => (window.app.extensions || []).some((e) => e.name === x)))""",
            arg=list(OUR_EXTENSIONS), timeout=timeout * 1000)
        # the websocket's client id, so that "executed" messages for our prompts reach this tab
        self.page.wait_for_function(
            """async () => { const { api } = await import("/scripts/api.js"); return !!api.clientId; }""",
            timeout=timeout * 1000, polling=250)
        self.close_dialogs()

    def close_dialogs(self):
        """The current frontend opens its template browser on a new user's first visit, on a blank graph,
        shortly after the app is up."""
        try:
            self.page.wait_for_function("() => app.graph._nodes.length > 0 || !!document.querySelector('.p-dialog')",
                                        timeout=2000)
        except Exception:  # noqa: BLE001 - an empty restored graph and no dialog: nothing to close
            pass
        for _ in range(5):
            if not self.page.locator(".p-dialog:visible").count():
                return
            self.page.keyboard.press("Escape")
            time.sleep(0.3)

    def close(self):
        self.page.close()

    # -- facts ----------------------------------------------------------------------------------
    @property
    def frontend_version(self):
        """'1.27.10' on the current frontend; None on the 2024 one (it has no version global)."""
        return self.page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ || null")

    def unexpected_errors(self):
        """Console errors and uncaught exceptions left after the documented allow-lists."""
        bad = []
        for text, url in self.console_errors:
            if not any(re.search(m, text) and re.search(u, url or "") for m, u in NETWORK_NOISE):
                bad.append("console: %s (%s)" % (text[:500], url))
        for msg, stack in self.page_errors:
            ours = "/extensions/" in stack
            if ours or not any(re.search(m, msg) and re.search(s, stack) for m, s in KNOWN_FRONTEND_BUGS):
                bad.append("pageerror: %s\n%s" % (msg[:500], stack[:1500]))
        return bad

    def evaluate(self, js, arg=None):
        return self.page.evaluate(js, arg)

    # -- settings -------------------------------------------------------------------------------
    def setting(self, sid):
        return self.evaluate("""(id) => app.extensionManager?.setting?.get
                                   ? app.extensionManager.setting.get(id)
                                   : app.ui.settings.getSettingValue(id)""", sid)

    def set_setting(self, sid, value):
        self.evaluate("""async ([id, v]) => app.extensionManager?.setting?.set
                            ? await app.extensionManager.setting.set(id, v)
                            : await app.ui.settings.setSettingValueAsync(id, v)""", [sid, value])

    # -- graph ----------------------------------------------------------------------------------
    def load_workflow(self, workflow):
        """Loads a UI-format workflow; returns the node types it uses that the frontend does not know."""
        return self.evaluate("""async (wf) => {
            const missing = [...new Set(wf.nodes.map((n) => n.type))]
              .filter((t) => !(t in LiteGraph.registered_node_types));
            await app.loadGraphData(wf);
            return missing;
        }""", workflow)

    def graph_nodes(self):
        return self.evaluate("""() => app.graph._nodes.map((n) => ({id: n.id, type: n.type,
            pos: [n.pos[0], n.pos[1]], size: [n.size[0], n.size[1]],
            widgets: Object.fromEntries((n.widgets || []).map((w) => [w.name, w.value]))}))""")

    def nodes_of_type(self, node_type):
        return [n for n in self.graph_nodes() if n["type"] == node_type]

    def set_widgets(self, node_id, values):
        self.evaluate("""([id, values]) => {
            const node = app.graph.getNodeById(id);
            for (const [name, v] of Object.entries(values)) {
              const w = (node.widgets || []).find((w) => w.name === name);
              if (!w) throw new Error(`node ${id} (${node.type}) has no widget ${name}`);
              w.value = v;
              w.callback?.(v);
            }
        }""", [node_id, values])

    def add_node(self, node_type, widgets=None, pos=(0, 0)):
        node_id = self.evaluate("""([type, pos]) => {
            const n = LiteGraph.createNode(type);
            if (!n) throw new Error("cannot create " + type);
            n.pos = [pos[0], pos[1]];
            app.graph.add(n);
            return n.id;
        }""", [node_type, list(pos)])
        if widgets:
            self.set_widgets(node_id, widgets)
        return node_id

    def connect(self, src_id, src_slot, dst_id, dst_slot):
        self.evaluate("""([a, i, b, j]) => {
            const link = app.graph.getNodeById(a).connect(i, app.graph.getNodeById(b), j);
            if (!link) throw new Error(`could not link ${a}:${i} -> ${b}:${j}`);
        }""", [src_id, src_slot, dst_id, dst_slot])

    def clear_graph(self):
        self.evaluate("() => { app.graph.clear(); app.graph.setDirtyCanvas(true, true); }")

    def page_time(self):
        return self.evaluate("() => Date.now()")

    def queue(self):
        """Queues the page's graph through the frontend's own client (so the websocket of this tab gets
        the "executed" messages); returns the prompt id."""
        return self.evaluate("""async () => {
            const { api } = await import("/scripts/api.js");
            const p = await app.graphToPrompt();
            try {
              const res = await api.queuePrompt(0, p);
              return res.prompt_id;
            } catch (e) {
              throw new Error("prompt rejected: " + JSON.stringify(e.response ?? String(e)).slice(0, 3000));
            }
        }""")

    def wait_badge(self, node_id, since_ms, timeout=300):
        """Waits until the node has drawn a badge from a UI output received after `since_ms`."""
        self.page.wait_for_function(
            """([id, since]) => { const b = app.graph.getNodeById(id)?.sdaccelBadge;
                                  return !!(b && b.received >= since && b.drawCount > 0); }""",
            arg=[node_id, since_ms], timeout=timeout * 1000, polling=200)
        return self.badge(node_id)

    def badge(self, node_id):
        """{output, lines (as drawn), draws} of the node's badge, or None."""
        return self.evaluate("""(id) => { const b = app.graph.getNodeById(id)?.sdaccelBadge;
            return b ? {output: b.output, lines: b.drawnLines || [], draws: b.drawCount || 0,
                        received: b.received} : null; }""", node_id)

    def wait_redraw(self, node_id):
        """Forces a canvas redraw and waits until the node's badge has been drawn again."""
        before = (self.badge(node_id) or {}).get("draws", 0)
        self.evaluate("() => { app.graph.setDirtyCanvas(true, true); app.canvas.draw(true, true); }")
        self.page.wait_for_function(
            """([id, n]) => (app.graph.getNodeById(id)?.sdaccelBadge?.drawCount || 0) > n""",
            arg=[node_id, before], timeout=10000, polling=100)
        return self.badge(node_id)

    def node_height(self, node_id):
        return self.evaluate("(id) => app.graph.getNodeById(id).computeSize()[1]", node_id)

    # -- view and pictures ------------------------------------------------------------------------
    def hide_overlays(self):
        self.evaluate("(sels) => sels.forEach((s) => document.querySelectorAll(s).forEach((e) => e.style.display = 'none'))",
                      OVERLAYS)

    def frame(self, node_ids=None, margin=40, max_scale=1.25):
        """Pans and zooms the canvas so the nodes (default: all) fill it, with the floating panels hidden;
        returns their box on the page as a Playwright clip {x, y, width, height}."""
        self.hide_overlays()
        box = self.evaluate("""([ids, margin, maxScale]) => {
            const c = app.canvas, el = c.canvas, title = LiteGraph.NODE_TITLE_HEIGHT || 30;
            const nodes = ids ? ids.map((i) => app.graph.getNodeById(i)) : app.graph._nodes;
            let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
            for (const n of nodes) {
              const h = Math.max(n.size[1], n.computeSize()[1]);
              // 22: room above the title for the current frontend's node-source badge
              x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - title - 22);
              x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + h);
            }
            const w = el.clientWidth, h = el.clientHeight;
            const s = Math.min(maxScale, (w - 2 * margin) / (x1 - x0), (h - 2 * margin) / (y1 - y0));
            c.ds.scale = s;
            c.ds.offset[0] = w / 2 / s - (x0 + x1) / 2;
            c.ds.offset[1] = h / 2 / s - (y0 + y1) / 2;
            c.setDirty(true, true);
            c.draw(true, true);
            const r = el.getBoundingClientRect();
            const sx = r.left + (x0 + c.ds.offset[0]) * s, sy = r.top + (y0 + c.ds.offset[1]) * s;
            return {x: Math.max(0, sx - margin / 2), y: Math.max(0, sy - margin / 2),
                    width: (x1 - x0) * s + margin, height: (y1 - y0) * s + margin};
        }""", [node_ids, margin, max_scale])
        time.sleep(0.3)   # let the frontend's own draw loop settle (link and widget layers)
        return box

    def screenshot(self, path, clip=None):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if clip:
            vw, vh = VIEWPORT["width"], VIEWPORT["height"]
            clip = {"x": clip["x"], "y": clip["y"], "width": min(clip["width"], vw - clip["x"]),
                    "height": min(clip["height"], vh - clip["y"])}
        self.page.screenshot(path=path, clip=clip)
        return path


def poll(fn, timeout=10.0, interval=0.1):
    """fn()'s first truthy value within `timeout` seconds, else its last value."""
    t_end = time.time() + timeout
    while True:
        v = fn()
        if v or time.time() > t_end:
            return v
        time.sleep(interval)


def load_json(path):
    with open(path) as f:
        return json.load(f)


def ui_workflows(folder):
    """{name: path} of the UI-format workflows in `folder` (X.json, not the X.api.json twins)."""
    return {f[:-len(".json")]: os.path.join(folder, f) for f in sorted(os.listdir(folder))
            if f.endswith(".json") and not f.endswith(".api.json")}
