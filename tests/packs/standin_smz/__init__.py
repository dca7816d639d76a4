"""Test stand-in for shiimizu/ComfyUI_smZNodes' sampling hooks and its Settings node (read in smZNodes.py:
register_hooks, KSampler_sample, KSAMPLER_sample, sampling_function; modules/rng.py: prepare_noise,
_find_outer_instance; nodes.py: smZ_Settings). docs/other_packs.md.

At import, for every graph whether it uses the pack or not, smZ replaces ComfyUI functions by name in their
modules, keeping the originals:
- `comfy.samplers.KSampler.sample`: sets a copy of the sampled patcher's model_options, with the schedule's
  sigmas in it, on that patcher (for a stock KSampler: the loader's patcher, which the executor caches);
- `comfy.samplers.KSAMPLER.sample`: pops those sigmas from the run's model_options and keeps them;
- `comfy.samplers.sampling_function`: with the Settings node's options on the model, negative guidance minimum
  sigma: on odd steps whose sigma is below `s_min_uncond`, cond_scale 1.0 (ComfyUI then skips the uncond:
  that step's UNet call has half the batch); the step is found by a host read of the sigmas;
- `comfy.sample.prepare_noise`: finds the options on a `model` local of the calling frames (a ModelPatcher),
  and with them seeds the noise with seed + ENSD (eta_noise_seed_delta), as A1111 does.
The Settings node clones the model with its options object in model_options['smZ_opts']. Used only by the
tests.
"""
import inspect
import types

import comfy.model_patcher
import comfy.sample
import comfy.samplers

KEY = "smZ_opts"
_store = {}


class Options(types.SimpleNamespace):
    """smZ's options object: equal by content."""

    def __eq__(self, other):
        return isinstance(other, Options) and vars(self) == vars(other)


def _options_of_caller_model():
    frame, depth = inspect.currentframe(), 0
    while frame is not None and depth < 10:
        found = frame.f_locals.get("model")
        if isinstance(found, comfy.model_patcher.ModelPatcher):
            return found.model_options.get(KEY)
        frame, depth = frame.f_back, depth + 1
    return None


def KSampler_sample(*args, **kwargs):
    self = args[0]
    options = getattr(self.model, "model_options", None)
    if options is not None:
        sigmas = kwargs["sigmas"] if "sigmas" in kwargs else (args[10] if len(args) > 10 else None)
        if sigmas is None:
            sigmas = getattr(self, "sigmas", None)
        if sigmas is not None:
            options = options.copy()
            options["sigmas"] = sigmas
            self.model.model_options = options
    return _store["KSampler_sample"](*args, **kwargs)


def KSAMPLER_sample(*args, **kwargs):
    extra_args = kwargs["extra_args"] if "extra_args" in kwargs else args[3]
    sigmas = extra_args["model_options"].pop("sigmas", None)
    _store["sigmas"] = sigmas if sigmas is not None else (kwargs["sigmas"] if "sigmas" in kwargs else args[2])
    return _store["KSAMPLER_sample"](*args, **kwargs)


def sampling_function(*args, **kwargs):
    args = list(args)
    model_options = (kwargs["model_options"] if "model_options" in kwargs else args[6]).copy()
    if "model_options" in kwargs:
        kwargs["model_options"] = model_options
    else:
        args[6] = model_options
    opts = model_options.get(KEY)
    if opts is not None and opts.s_min_uncond > 0:
        sigma = kwargs["timestep"] if "timestep" in kwargs else args[2]
        sigmas = _store["sigmas"]
        step = int((sigmas.to(sigma.device) - sigma[0]).abs().argmin().item())
        if step % 2 and float(sigma[0]) < opts.s_min_uncond:
            if "cond_scale" in kwargs:
                kwargs["cond_scale"] = 1.0
            else:
                args[5] = 1.0
    return _store["sampling_function"](*args, **kwargs)


def prepare_noise(latent_image, seed, *args, **kwargs):
    opts = _options_of_caller_model()
    if opts is not None:
        seed = seed + opts.eta_noise_seed_delta
    return _store["prepare_noise"](latent_image, seed, *args, **kwargs)


_HOOKED = ((comfy.samplers.KSampler, "sample", KSampler_sample),
           (comfy.samplers.KSAMPLER, "sample", KSAMPLER_sample),
           (comfy.samplers, "sampling_function", sampling_function),
           (comfy.sample, "prepare_noise", prepare_noise))


def _register_hooks():
    for parent, name, hook in _HOOKED:
        if hook.__name__ not in _store:
            _store[hook.__name__] = getattr(parent, name)
            setattr(parent, name, hook)


def _unregister_hooks():
    """For the GPU tests' isolation in one process (smZ itself never takes its hooks out)."""
    for parent, name, hook in _HOOKED:
        if hook.__name__ in _store:
            setattr(parent, name, _store.pop(hook.__name__))


class SmZLikeSettings:
    CATEGORY = "tests/stand-ins"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "s_min_uncond": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 100.0}),
                             "ENSD": ("INT", {"default": 0, "min": 0, "max": 2 ** 31})}}

    def apply(self, model, s_min_uncond, ENSD):
        model = model.clone()
        model.model_options[KEY] = Options(s_min_uncond=s_min_uncond, eta_noise_seed_delta=ENSD)
        return (model,)


_register_hooks()

NODE_CLASS_MAPPINGS = {"SmZLikeSettings": SmZLikeSettings}
NODE_DISPLAY_NAME_MAPPINGS = {"SmZLikeSettings": "smZ-like Settings (test stand-in)"}
