"""Stand-in for A1111's `modules.api.models`: `OptionsModel`, the response model of `GET /sdapi/v1/options`,
is a pydantic model built from `shared.opts.data_labels` when this module is first imported (one optional
field per option, its default and its label), as in A1111 v1.10.1 and Forge. Options registered after that
import are not fields of it, and FastAPI's response-model filtering leaves them out of the GET."""
from typing import Any, Optional

import pydantic

from .. import shared

fields = {}
for key, metadata in shared.opts.data_labels.items():
    kind = type(metadata.default) if metadata.default is not None else Any
    fields[key] = (Optional[kind], pydantic.Field(default=metadata.default, description=metadata.label))

OptionsModel = pydantic.create_model("Options", **fields)
