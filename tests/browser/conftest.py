"""Browser tests: the pack's JS in ComfyUI's real frontend, in headless Debian Chromium via Playwright.

The ComfyUI server is the one of the server tests: tests/server/conftest.py's `comfy` and `models`
fixtures are loaded from that file (not copied), so the same ComfyUI ($SDACCEL_COMFYUI or the 2024 copy),
models and environment are used. When tests/server and tests/browser run in one pytest session, each
folder starts its own server (session fixtures are per conftest folder).

Needs /usr/bin/chromium (or $SDACCEL_CHROMIUM) and the `playwright` package: dev/setup_chromium.sh
(run by dev/test.sh) installs the first, dev/setup_env.sh the second (no `playwright install`: the system
Chromium is used). Without Chromium the tests that drive the browser are skipped with the reason, so the
rest of the suite runs on a machine without root; SDACCEL_REQUIRE_BROWSER=1 (.ci/run) fails them instead.
Screenshots go to $SDACCEL_ARTIFACTS (default: a temporary folder, printed at the end), one sub-folder per
ComfyUI version.
"""
import importlib.util
import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _load_server_conftest():
    spec = importlib.util.spec_from_file_location("sdaccel_server_conftest",
                                                  os.path.join(REPO, "tests", "server", "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_server = _load_server_conftest()
comfy = _server.comfy      # noqa: F811 - re-exported session fixtures
models = _server.models

import browser_util  # noqa: E402


@pytest.fixture(scope="session")
def comfy_version(comfy):
    stats = comfy.get("/system_stats")
    return stats.get("system", {}).get("comfyui_version") or "2024"


@pytest.fixture(scope="session")
def artifacts(comfy_version):
    root = os.environ.get("SDACCEL_ARTIFACTS") or tempfile.mkdtemp(prefix="sdaccel_artifacts_")
    path = os.path.join(root, "comfyui-%s" % comfy_version)
    os.makedirs(path, exist_ok=True)
    yield path
    print("\n[browser tests] screenshots in %s" % path)


@pytest.fixture(scope="session")
def workflow_inputs(comfy):
    """The images the shipped workflows' LoadImage nodes name (e.g. example.png), in the server's input
    folder: a template loads with its own input, as after the user picked one."""
    from PIL import Image, ImageDraw
    made = []
    for path in browser_util.ui_workflows(browser_util.WORKFLOWS).values():
        for node in browser_util.load_json(path)["nodes"]:
            if node["type"] == "LoadImage" and node.get("widgets_values"):
                dst = os.path.join(comfy.input_dir, node["widgets_values"][0])
                if not os.path.exists(dst):
                    im = Image.new("RGB", (256, 256), (40, 60, 90))
                    ImageDraw.Draw(im).ellipse((64, 48, 192, 208), fill=(230, 200, 120))
                    im.save(dst)
                    made.append(dst)
    return made


@pytest.fixture(scope="session")
def browser_context():
    missing = browser_util.chromium_missing()
    if missing:   # only where SDACCEL_REQUIRE_BROWSER=1: elsewhere these tests were skipped at collection
        pytest.fail(missing)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run dev/setup_env.sh")
    with sync_playwright() as p:
        ctx = browser_util.launch(p)
        yield ctx
        ctx.close()


@pytest.fixture
def ui(browser_context, comfy, artifacts, request):
    """A ComfyUI tab, loaded and ready; a screenshot is kept if the test fails."""
    page = browser_util.ComfyPage(browser_context, comfy.url).open()
    yield page
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        try:
            page.screenshot(os.path.join(artifacts, "FAILED_%s.png" % request.node.name))
        except Exception:  # noqa: BLE001 - best effort
            pass
    page.close()


def pytest_collection_modifyitems(config, items):
    """Without Chromium, the tests that drive it are skipped with the reason at collection, before any
    ComfyUI server starts for them; where it is required (CI), they run and fail with that reason."""
    missing = browser_util.chromium_missing()
    if not missing or os.environ.get("SDACCEL_REQUIRE_BROWSER") == "1":
        return
    for item in items:
        if "browser_context" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=missing))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
