"""Stand-in for the category registry of A1111's `modules.options` (1.6+): `categories.mapping` holds
the categories `shared_options` registers, id -> an object with a `label`."""
import types


class _Categories:
    def __init__(self):
        self.mapping = {}

    def register_category(self, category_id, label):
        self.mapping.setdefault(category_id, types.SimpleNamespace(id=category_id, label=label))
        return category_id


categories = _Categories()
for _id, _label in (("saving", "Saving images"), ("sd", "Stable Diffusion"), ("ui", "User Interface"),
                    ("system", "System"), ("postprocessing", "Postprocessing"), ("training", "Training")):
    categories.register_category(_id, _label)
