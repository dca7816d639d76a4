"""The pack's frontend extensions load cleanly, and their settings exist, show under "SD Accel" and
persist across a reload (stored by the ComfyUI server, per user)."""
import os

from browser_util import OUR_EXTENSIONS, PACK_DIR_NAME, REPO, poll

SHOW, DETAIL = "SDAccel.ShowBadges", "SDAccel.BadgeDetail"
DEFAULTS = {SHOW: True, DETAIL: "compact"}
JS_DIR = os.path.join(REPO, "js")


def test_extensions_load_without_console_errors(ui, comfy, artifacts):
    served = comfy.get("/extensions")
    for f in sorted(os.listdir(JS_DIR)):
        if f.endswith(".js"):
            assert "/extensions/%s/%s" % (PACK_DIR_NAME, f) in served, served
    names = ui.evaluate("() => (app.extensions || []).map((e) => e.name).filter((n) => n.startsWith('SDAccel.'))")
    assert len(names) == len(set(names)), "registered twice: %s" % names
    assert set(OUR_EXTENSIONS) <= set(names), names
    hooked = ui.evaluate("""() => ['SDAccelKSampler', 'SDAccelApply', 'SDAccelCannyMap']
        .filter((t) => LiteGraph.registered_node_types[t])
        .map((t) => [t, LiteGraph.registered_node_types[t].prototype.sdaccelBadges === true])""")
    assert hooked and all(ok for _, ok in hooked), hooked
    ui.screenshot(os.path.join(artifacts, "extensions_loaded.png"))
    assert not ui.unexpected_errors(), "\n".join(ui.unexpected_errors())


def _show_settings_dialog(ui):
    """Opens the settings dialog at the SD Accel section; returns a function that sets a value there
    through the dialog's own controls, as a user does."""
    page = ui.page
    if ui.frontend_version:   # current frontend: categories in a side list, PrimeVue controls
        ui.evaluate("() => app.extensionManager.command.execute('Comfy.ShowSettingsDialog')")
        page.get_by_role("option", name="SD Accel", exact=True).click()
        page.get_by_text("Show run badges on SD Accel nodes").wait_for()

        def set_value(sid, value):
            if isinstance(value, bool):
                if ui.setting(sid) != value:
                    page.locator('[id="%s"]' % sid).click()
            else:
                page.locator('[id="%s"]' % sid).click()
                page.get_by_role("option", name=value, exact=True).click()
    else:                     # 2024 frontend: one table, rows labelled by name
        ui.evaluate("() => app.ui.settings.show()")
        page.get_by_text("SD Accel: Show run badges on SD Accel nodes").wait_for()

        def set_value(sid, value):
            html_id = sid.replace(".", "-")
            if isinstance(value, bool):
                page.locator("#" + html_id).set_checked(value)
            else:
                page.locator('tr:has(label[for="%s"]) select' % html_id).select_option(value)
    return set_value


def test_settings_exist_and_persist_across_reload(ui, comfy, artifacts):
    registered = ui.evaluate("""() => { const l = app.ui.settings.settingsLookup;
        return Object.keys(l).filter((k) => k.startsWith('SDAccel.')); }""")
    assert sorted(registered) == sorted(DEFAULTS), registered
    try:
        for sid, value in DEFAULTS.items():   # known state, whatever an earlier run left
            ui.set_setting(sid, value)
        set_value = _show_settings_dialog(ui)
        ui.screenshot(os.path.join(artifacts, "settings_dialog.png"))
        set_value(SHOW, False)
        set_value(DETAIL, "full")
        assert ui.setting(SHOW) is False and ui.setting(DETAIL) == "full"
        stored = poll(lambda: comfy.get("/settings/%s" % SHOW) is False
                      and comfy.get("/settings/%s" % DETAIL) == "full")
        assert stored, "the settings did not reach the server"   # stored by the server ...
        ui.reload()                                          # ... and read back by a fresh page
        assert ui.setting(SHOW) is False and ui.setting(DETAIL) == "full"
        read = ui.evaluate("""async (folder) => {
            const m = await import(`/extensions/${folder}/sdaccel_badges.js`);
            return [m.badgesShown(), m.badgeDetail()]; }""", PACK_DIR_NAME)
        assert read == [False, "full"], read                 # what the badge code itself sees
    finally:
        for sid, value in DEFAULTS.items():
            ui.set_setting(sid, value)
    assert poll(lambda: comfy.get("/settings/%s" % SHOW) is True)
    assert not ui.unexpected_errors(), "\n".join(ui.unexpected_errors())
