"""Shipped workflows as templates: every UI-format workflow in workflows/ loads in the frontend with no
missing node, has a thumbnail, and (on ComfyUI with a custom-node template browser, 0.3.x) is listed
there, without the API-format twins, and opens from there.

How ComfyUI finds them: app/custom_node_manager.py serves GET /workflow_templates, a map
{custom_nodes folder name: [file names without .json]} built by globbing
custom_nodes/*/{example_workflows,example,examples,workflow,workflows}/*.json, and serves each such folder
statically at /api/workflow_templates/<folder>/; the frontend fetches <name>.json from there and the
thumbnail <name>.jpg next to it. Our workflows/ folder is on that list, so nothing needs copying or
linking; js/sdaccel_templates.js drops the X.api names (X.api.json would not open as a template)."""
import os

import pytest
from PIL import Image

from browser_util import PACK_DIR_NAME, WORKFLOWS, load_json, ui_workflows

UI_WORKFLOWS = ui_workflows(WORKFLOWS)
THUMB_MAX_BYTES = 150 * 1024


def test_every_ui_workflow_has_an_api_twin_and_a_jpeg_thumbnail():
    assert UI_WORKFLOWS, "no UI workflows in %s" % WORKFLOWS
    for name in UI_WORKFLOWS:
        assert os.path.exists(os.path.join(WORKFLOWS, name + ".api.json")), "%s has no API twin" % name
        thumb = os.path.join(WORKFLOWS, name + ".jpg")
        assert os.path.exists(thumb), ("%s.jpg missing: the template browser shows <name>.jpg; make it with "
                                       "`python tests/browser/make_thumbnails.py`" % name)
        assert os.path.getsize(thumb) <= THUMB_MAX_BYTES, "%s is over %d KiB" % (thumb, THUMB_MAX_BYTES // 1024)
        with Image.open(thumb) as im:
            assert im.format == "JPEG" and min(im.size) >= 200, (im.format, im.size)


def _check_loaded(ui, workflow):
    nodes = ui.graph_nodes()
    assert len(nodes) == len(workflow["nodes"]), (len(nodes), len(workflow["nodes"]))
    unknown = ui.evaluate("() => app.graph._nodes.map((n) => n.type).filter((t) => !(t in LiteGraph.registered_node_types))")
    assert not unknown, "missing node types: %s" % unknown
    assert sorted(n["type"] for n in nodes) == sorted(n["type"] for n in workflow["nodes"])


@pytest.mark.parametrize("name", sorted(UI_WORKFLOWS))
def test_ui_workflow_loads_without_missing_nodes(ui, artifacts, workflow_inputs, name):
    workflow = load_json(UI_WORKFLOWS[name])
    missing = ui.load_workflow(workflow)
    assert not missing, "%s uses node types this ComfyUI does not have: %s" % (name, missing)
    _check_loaded(ui, workflow)
    ui.frame(max_scale=1.0)
    ui.screenshot(os.path.join(artifacts, "workflow_%s.png" % name))
    assert not ui.unexpected_errors(), "\n".join(ui.unexpected_errors())


def _open_template_browser(ui):
    ui.evaluate("() => app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    ui.page.get_by_role("option", name=PACK_DIR_NAME, exact=True).click()
    cards = ui.page.locator('[data-testid^="template-workflow-"]')
    cards.first.wait_for()
    return cards


def test_template_browser_lists_and_opens_every_ui_workflow(ui, comfy, artifacts, workflow_inputs):
    listed = comfy.get("/workflow_templates") if _has_template_route(comfy) else None
    if listed is None:
        pytest.skip("this ComfyUI (2024) has no custom-node template browser")
    # the server lists every *.json of workflows/, API twins included ...
    assert set(UI_WORKFLOWS) <= set(listed.get(PACK_DIR_NAME, [])), listed
    for name in UI_WORKFLOWS:
        thumb = comfy.get("/api/workflow_templates/%s/%s.jpg" % (PACK_DIR_NAME, name))
        assert thumb[:3] == b"\xff\xd8\xff", "thumbnail of %s not served" % name
    # ... the browser shows exactly the UI-format ones, each with its thumbnail
    cards = _open_template_browser(ui)
    ids = sorted(cards.nth(i).get_attribute("data-testid") for i in range(cards.count()))
    assert ids == sorted("template-workflow-" + n for n in UI_WORKFLOWS), ids
    ui.page.wait_for_function(
        """(n) => { const imgs = [...document.querySelectorAll('[data-testid^="template-workflow-"] img')];
                    return imgs.length >= n && imgs.every((i) => i.complete && i.naturalWidth > 0); }""",
        arg=len(UI_WORKFLOWS), timeout=20000)
    ui.screenshot(os.path.join(artifacts, "template_browser.png"))

    for name in sorted(UI_WORKFLOWS):
        if ui.page.locator(".p-dialog:visible").count() == 0:
            cards = _open_template_browser(ui)
        ui.page.locator('[data-testid="template-workflow-%s"]' % name).click()
        workflow = load_json(UI_WORKFLOWS[name])
        ui.page.wait_for_function("(n) => app.graph._nodes.length === n && !document.querySelector('.p-dialog')",
                                  arg=len(workflow["nodes"]), timeout=20000)
        _check_loaded(ui, workflow)
        ui.frame(max_scale=1.0)
        ui.screenshot(os.path.join(artifacts, "template_opened_%s.png" % name))
    assert not ui.unexpected_errors(), "\n".join(ui.unexpected_errors())


def _has_template_route(comfy):
    import urllib.error
    try:
        comfy.get("/workflow_templates")
        return True
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise
