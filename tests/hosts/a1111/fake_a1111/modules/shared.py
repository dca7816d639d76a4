"""Stand-in for A1111's `modules.shared` options layer.

As in A1111: `opts.data_labels` is the `options_templates` dict itself until the settings UI reorders
it; `opts.data` holds saved values and only gains a new key through `add_option` (which keeps a value
loaded from config.json); `opts.set(key, value, is_api=True)` runs `onchange` and rolls back if it
raises; an unknown key raises KeyError. The API's options model is a snapshot of `data_labels` keys
built when `modules.api.models` is first imported (fake_a1111/modules/api/models.py), and
`GET /sdapi/v1/options` returns `opts.data` filtered to that model's fields (`api_get_options`): options
registered only later, in `on_ui_settings`, are missing from the GET (measured on A1111 with --nowebui),
and so are options registered after another extension imported the API first (Forge's built-in
ControlNet imports `modules.api.api` before user extensions load).
"""
options_templates = {}
loaded_hypernetworks = []
device = "cpu"


class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None, onchange=None,
                 section=None, refresh=None, comment_before="", comment_after="", infotext=None,
                 restrict_api=False, category_id=None):
        self.default, self.label, self.component, self.component_args = default, label, component, component_args
        self.onchange, self.section, self.category_id, self.refresh = onchange, section, category_id, refresh
        self.comment_before, self.comment_after, self.infotext = comment_before, comment_after, infotext
        self.restrict_api = restrict_api
        self.do_not_save = False

    def info(self, info):
        self.comment_after += "<span class='info'>(%s)</span>" % info
        return self


def options_section(section_identifier, options_dict):
    for v in options_dict.values():
        v.section = tuple(section_identifier[:2])
        if len(section_identifier) == 3:
            v.category_id = section_identifier[2]
    return options_dict


class Options:
    def __init__(self, data_labels):
        object.__setattr__(self, "data_labels", data_labels)
        object.__setattr__(self, "data", {k: v.default for k, v in data_labels.items()})

    def __getattr__(self, item):
        if item in self.data:
            return self.data[item]
        if item in self.data_labels:
            return self.data_labels[item].default
        raise AttributeError(item)

    def add_option(self, key, info):
        self.data_labels[key] = info
        if key not in self.data:
            self.data[key] = info.default

    def set(self, key, value, is_api=False, run_callbacks=True):
        old = self.data.get(key, None)
        if old == value:
            return False
        option = self.data_labels[key]
        self.data[key] = value
        if run_callbacks and option.onchange is not None:
            try:
                option.onchange()
            except Exception:
                self.data[key] = old
                return False
        return True


opts = Options(options_templates)


def api_options_model():
    """The response model A1111's `Api()` registers for `GET /sdapi/v1/options` (at app start, after the
    extensions' scripts were imported)."""
    from .api import models
    return models.OptionsModel


def api_get_options(model):
    """`GET /sdapi/v1/options` through `model`: the saved values, filtered to the model's fields."""
    return model(**opts.data).model_dump()
