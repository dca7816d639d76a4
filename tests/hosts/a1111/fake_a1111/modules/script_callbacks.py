"""Stand-in for A1111's `modules.script_callbacks`: registration appends, invocation calls in order
(script_unloaded in reverse), `clear_callbacks` empties everything as `scripts.load_scripts` does."""
_callbacks = {k: [] for k in ("ui_settings", "model_loaded", "script_unloaded", "list_unets", "app_started")}


def clear_callbacks():
    for v in _callbacks.values():
        v.clear()


def on_ui_settings(fn, *, name=None):
    _callbacks["ui_settings"].append(fn)


def on_model_loaded(fn, *, name=None):
    _callbacks["model_loaded"].append(fn)


def on_script_unloaded(fn, *, name=None):
    _callbacks["script_unloaded"].append(fn)


def on_list_unets(fn, *, name=None):
    _callbacks["list_unets"].append(fn)


def on_app_started(fn, *, name=None):
    _callbacks["app_started"].append(fn)


def ui_settings_callback():
    for fn in _callbacks["ui_settings"]:
        fn()


def model_loaded_callback(sd_model):
    for fn in _callbacks["model_loaded"]:
        fn(sd_model)


def script_unloaded_callback():
    for fn in reversed(_callbacks["script_unloaded"]):
        fn()


def list_unets_callback():
    res = []
    for fn in _callbacks["list_unets"]:
        fn(res)
    return res


def app_started_callback(demo, app):
    for fn in _callbacks["app_started"]:
        fn(demo, app)
