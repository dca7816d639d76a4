"""sd-webui-freeu's settings, set by its script before each generation (`instance`), and the sampling step the
hook reads (the extension reads A1111's `shared.state.sampling_step`; a test sets `sampling_step` here)."""
import types

instance = types.SimpleNamespace(enable=False, stages={}, start_step=0, stop_step=None)
sampling_step = 0
