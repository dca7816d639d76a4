"""The `attention` option on ComfyUI: SD Accel's attention backend (engine/patches/attention.py) handed to the
UNet's blocks as a transformer option, never as an attention replace patch (those are other packs' to set)."""
from ...engine.patches import attention
from .step_wrappers import mark_inert


def transformer_blocks(diffusion_model):
    """(block_name, index) of every UNet block holding a transformer, as ComfyUI keys attention patches."""
    def has_transformer(m):
        return any(type(s).__name__ == "SpatialTransformer" for s in m.modules())
    out = []
    for name, blocks in (("input", getattr(diffusion_model, "input_blocks", ())),
                         ("output", getattr(diffusion_model, "output_blocks", ()))):
        out += [(name, i) for i, b in enumerate(blocks) if has_transformer(b)]
    mid = getattr(diffusion_model, "middle_block", None)
    if mid is not None and has_transformer(mid):
        out.append(("middle", 0))
    return out


def install(clone, backend, options):
    """Our attention backend as a transformer option (see attention.TRANSFORMER_OPTION): the fused transformer
    blocks read it; the host's own blocks take it through current ComfyUI's attention override. Where another pack
    set that override, theirs runs in every block. Returns (the number of transformer blocks it can act in, why
    none where 0)."""
    attend = mark_inert(attention.attention_fn(backend), options, "attention")
    to = clone.model_options.setdefault("transformer_options", {})
    to[attention.TRANSFORMER_OPTION] = attend
    if attention.another_packs_override(to):
        # theirs decides every block's attention, the fused ones' too (a pack applied after ours takes it over too)
        return 0, "another pack set ComfyUI's attention override"
    reaches_host_blocks = host_has_override()
    if reaches_host_blocks:
        to[attention.HOST_OVERRIDE] = mark_inert(_attention_override(attend), options, "attention_override")
    elif not options.fused_kernels:
        return 0, ("this ComfyUI has no attention override: the backend runs in fused transformer blocks only "
                   "(fused_kernels is off)")
    return len(transformer_blocks(clone.model.diffusion_model)), None


def host_has_override():
    try:
        import comfy.ldm.modules.attention as host_attention
    except ImportError:
        return False
    return hasattr(host_attention, "wrap_attn")


def _attention_override(attend):
    """Current ComfyUI's `optimized_attention_override(func, q, k, v, heads, ...)`: ours for the plain call
    (ldm layout, no mask, the model's own precision), the host's `func` for any other."""
    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        if mask is None and attn_precision is None and not skip_reshape and not skip_output_reshape \
                and q.dim() == 3:
            return attend(q, k, v, heads)
        return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                    skip_output_reshape=skip_output_reshape, **kwargs)
    setattr(override, attention.OURS, True)
    return override
