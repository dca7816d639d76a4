"""The two kinds of step-cache call on ComfyUI's ldm UNetModel (engine/step_cache for the algorithm).

With skip branch b of a UNet with L input and L output blocks, the deep feature is `h` as it enters output
block L-1-b (before that block's output_block_patch and its concatenation with the skip): the output of
output block L-2-b, or the middle block's where b = L-1.
  * full call: the host's own forward, unchanged, with one output_block_patch put first in the call's list
    that keeps a copy of that `h` (first, so what other patches do to it, FreeU scaling it in place, is
    done again on every cached call rather than baked into the feature);
  * cached call: input blocks 0..b and output blocks L-1-b..L-1 only, through the host's own
    forward_timestep_embed and apply_control, on the kept feature. The blocks that do not run are skipped
    whole, with what belongs to them: their ControlNet residuals (the middle block's and the skip residuals
    the deep output blocks would have taken; the ones before are taken exactly as the stock forward takes
    them) and their patches. transformer_index counts on from where the stock forward would be, so a patch
    keyed by it (GLIGEN) sees the same index in the same block.
"""
import torch

FEATURE_PATCH = "output_block_patch"


def _openaimodel():
    from comfy.ldm.modules.diffusionmodules import openaimodel
    return openaimodel


def unsupported(unet, branch):
    """Why this diffusion model cannot run the step cache at skip branch `branch`, or None."""
    om = _openaimodel()
    if type(unet) is not om.UNetModel:
        return "the diffusion model is a %s, not ComfyUI's UNetModel" % type(unet).__name__
    if any(isinstance(m, (om.VideoResBlock, om.SpatialVideoTransformer)) for m in unet.modules()):
        return "a video UNet (temporal blocks)"
    n = len(unet.input_blocks)
    if len(unet.output_blocks) != n:
        return "%d input blocks but %d output blocks" % (n, len(unet.output_blocks))
    if not 0 <= branch < n:
        return "skip branch %d is outside this UNet's input blocks 0..%d" % (branch, n - 1)
    return None


def first_output(unet, branch):
    """The output block a cached call starts at (where the kept feature enters)."""
    return len(unet.output_blocks) - 1 - branch


def recording(transformer_options, block, sink):
    """A copy of the options whose output_block_patch list starts with the feature's recorder:
    `sink(h)` gets a copy of `h` at output block `block`."""
    def keep_feature(h, hsp, to):
        if to.get("block") == ("output", block):
            sink(h.clone())
        return h, hsp
    to = dict(transformer_options)
    patches = dict(to.get("patches") or {})
    patches[FEATURE_PATCH] = [keep_feature] + list(patches.get(FEATURE_PATCH) or ())
    to["patches"] = patches
    return to


def _shallow_control(control, skipped_outputs):
    """The residuals a cached call takes: the stock forward pops each list from its end, one entry per block;
    the middle block's and the deep output blocks' entries (the list's last `skipped_outputs`) go unused."""
    if control is None:
        return None
    out = {k: list(v) if isinstance(v, list) else v for k, v in control.items()}
    if isinstance(out.get("middle"), list):
        out["middle"] = []
    skips = out.get("output")
    if isinstance(skips, list) and skipped_outputs:
        out["output"] = skips[:max(0, len(skips) - skipped_outputs)]
    return out


def _transformers_before(unet, om, first):
    blocks = list(unet.input_blocks) + [unet.middle_block] + list(unet.output_blocks)[:first]
    return sum(isinstance(layer, om.SpatialTransformer) for b in blocks if b is not None for layer in b)


def _embedding(unet, om, x, timesteps, y, patches, to):
    emb = unet.time_embed(om.timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype))
    for p in patches.get("emb_patch") or ():
        emb = p(emb, unet.model_channels, to)
    if unet.num_classes is not None:
        emb = emb + unet.label_emb(y)
    return emb


def shallow_forward(unet, x, timesteps, context, y, control, to, feature, branch, **kwargs):
    """A cached call: the UNet's output from its shallow blocks and the kept `feature` (see the module doc)."""
    om = _openaimodel()
    patches = to.get("patches") or {}
    to["original_shape"] = list(x.shape)
    to["transformer_index"] = 0
    video = {"time_context": kwargs.get("time_context"), "image_only_indicator": kwargs.get("image_only_indicator"),
             "num_video_frames": kwargs.get("num_video_frames", getattr(unet, "default_num_video_frames", None))}
    emb = _embedding(unet, om, x, timesteps, y, patches, to)
    first = first_output(unet, branch)
    control = _shallow_control(control, first)
    h, hs = x, []
    for i in range(branch + 1):
        to["block"] = ("input", i)
        h = om.forward_timestep_embed(unet.input_blocks[i], h, emb, context, to, **video)
        h = om.apply_control(h, control, "input")
        for p in patches.get("input_block_patch") or ():
            h = p(h, to)
        hs.append(h)
        for p in patches.get("input_block_patch_after_skip") or ():
            h = p(h, to)
    # a patch may change h in place (FreeU does): the kept feature must reach the next cached call unchanged
    h = feature.clone() if patches.get(FEATURE_PATCH) else feature
    to["transformer_index"] = _transformers_before(unet, om, first)
    for j in range(first, len(unet.output_blocks)):
        to["block"] = ("output", j)
        hsp = om.apply_control(hs.pop(), control, "output")
        for p in patches.get(FEATURE_PATCH) or ():
            h, hsp = p(h, hsp, to)
        h = torch.cat([h, hsp], dim=1)
        del hsp
        h = om.forward_timestep_embed(unet.output_blocks[j], h, emb, context, to, hs[-1].shape if hs else None,
                                      **video)
    h = h.type(x.dtype)
    return unet.id_predictor(h) if unet.predict_codebook_ids else unet.out(h)
