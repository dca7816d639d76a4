"""Stand-in for A1111's `modules.api.models`: `OptionsModel`, the response model of `GET /sdapi/v1/options`,
is a pydantic model built from `shared.opts.data_labels` when this module is first imported (one optional
field per option, its default and its label), as in A1111 v1.10.1 and Forge, which import `create_model`
and `Field` from pydantic here. Options registered after that import are not fields of it, and FastAPI's
response-model filtering leaves them out of the GET. Without pydantic (a CI machine need not have it) the
same three operations stand in: fields with defaults, a subclass adding fields, dumping the known ones."""
from typing import Any, Optional

from .. import shared

try:
    from pydantic import Field, create_model
except ImportError:
    def Field(default=None, description=None):  # noqa: N802 - pydantic's name
        return default

    def create_model(name, __base__=None, **fields):
        known = dict(getattr(__base__, "model_fields", {}))
        known.update({k: v[1] for k, v in fields.items()})

        def __init__(self, **data):
            self._values = {k: data.get(k, default) for k, default in known.items()}

        def model_dump(self):
            return dict(self._values)
        return type(name, (__base__ or object,), {"model_fields": known, "__init__": __init__,
                                                   "model_dump": model_dump})

fields = {}
for key, metadata in shared.opts.data_labels.items():
    kind = type(metadata.default) if metadata.default is not None else Any
    fields[key] = (Optional[kind], Field(default=metadata.default, description=metadata.label))

OptionsModel = create_model("Options", **fields)
