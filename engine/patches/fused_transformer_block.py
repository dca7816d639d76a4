"""A BasicTransformerBlock whose residual adds run inside the LayerNorms that follow them.

ComfyUI's block does `x = attn1(norm1(x)) + x`, then `norm2(x)`, `x = attn2(...) + x`, then `norm3(x)`: each
add is a kernel of its own whose output the next norm reads straight back. The stand-in computes those
two pairs with `kernels.add_layer_norm` (the sum exactly as torch's add rounds it, the norm from that sum):
two launches fewer per block, 32 per SD1.5 step and 140 per SDXL step, same numbers.

Only the plain call is re-implemented, and only where the host's block source has the expected steps
(`eligible`): no transformer patches that act inside the block (attn1/attn2 patches, output patches, the
middle patch), no attention replace patch for this block, no ff_in, a residual stream (`is_res`), a
cross-attention. SD Accel's own attention backend, where a host sets one, runs in the block's attentions.
Any other call goes to the host's own forward, and the run report says so. The host keeps the body in `forward`
(current ComfyUI) or in `_forward` behind a checkpoint wrapper (ComfyUI 2024; in inference the wrapper only
calls it). Children (norms, attentions, feed-forward) are the block's own modules, called as the host calls
them, so their own patches (fused norms, GEGLU, attention backends) apply.
"""

from ...kernels._dispatch import REFERENCE, Outcome
from ...kernels.add_layer_norm import add_layer_norm
from . import attention
from . import fused_modules as fm
from ..reports import kernel_report
from . import stock_path

_STEPS = ("n = self.norm1(x)", "n = self.norm2(x)", "x = self.ff(self.norm3(x))",
          "self.attn1(n, context=context_attn1, value=value_attn1", "self.attn2(n, context=context_attn2, "
          "value=value_attn2", 'transformer_patches_replace.get("attn1", {})', "middle_patch")
_ADDS = ("x = n + x", "x += n")     # current ComfyUI, ComfyUI 2024 (in place on the block's input: same sum)
_PATCHES = ("attn1_patch", "attn1_output_patch", "middle_patch", "attn2_patch", "attn2_output_patch")
_PARAMS = ("self", "x", "context", "transformer_options")


class FusedTransformerBlock:
    sdaccel_kind = "transformer_block"
    sdaccel_attn_takes_options = True     # set per class at plan time: the host passes transformer_options

    def forward(self, x, context=None, transformer_options={}):  # noqa: B006 - the host's signature
        to = transformer_options
        if stock_path.LOCAL.depth or stock_path.compiling() or fm.host_replaced(self) or \
                fm.class_forward_replaced(type(self.norm2)):
            return fm.original_class(self).forward(self, x, context=context, transformer_options=to)
        if not _plain_call(to):
            kernel_report.record("transformer_add_norm", _HOST_STEPS)
            return fm.original_class(self).forward(self, x, context=context, transformer_options=to)
        n = self._attention("attn1", self.norm1(x), None, to)
        x, n = _add_norm(self.norm2, n, x)
        n = self._attention("attn2", n, context, to)
        x, n = _add_norm(self.norm3, n, x)
        return self.ff(n) + x

    def _attention(self, which, n, context, to):
        """The host's attention call, or SD Accel's own attention backend where a host set one
        (attention.TRANSFORMER_OPTION), the call is the plain one (_plain_call passed: no replace patch) and no
        other pack set the host's attention override (then the host's call runs it, as in the host's blocks)."""
        attn = getattr(self, which)
        attend = to.get(attention.TRANSFORMER_OPTION)
        if attend is None or getattr(attn, "attn_precision", None) is not None or not _host_attention(attn) \
                or attention.another_packs_override(to):
            kw = {"transformer_options": to} if self.sdaccel_attn_takes_options else {}
            return attn(n, context=context, value=None, **kw)
        kv = n if context is None else context
        return attn.to_out(attend(attn.to_q(n), attn.to_k(kv), attn.to_v(kv), self.n_heads))


def _host_attention(attn):
    """`attn` computes what ComfyUI's CrossAttention does around its attention (the projections SD Accel's backend
    is put between): another pack's module in its place (LayerDiffuse's attention sharing, an object patch) or
    another pack's forward on it or on its class is called as the host calls it."""
    return (type(attn).__name__ == "CrossAttention" and "forward" not in attn.__dict__
            and not fm.foreign_forwards(type(attn)))


# what kernel_report files when the block ran the host's own steps
_HOST_STEPS = Outcome(REFERENCE,
                      "a transformer patch acts inside the block (another pack's attention or output patch)")


def _add_norm(norm, n, x):
    w, b = fm.weights_of(norm, n) if norm.weight is not None else (None, norm.bias)
    x, n = add_layer_norm(n, x, norm.normalized_shape, w, b, norm.eps)
    kernel_report.record("transformer_add_norm", add_layer_norm.last_call)
    return x, n


def _plain_call(to):
    """No transformer patch and no attention replace patch acts inside this block on this call (the host
    would run other steps)."""
    patches = to.get("patches") or {}
    if any(patches.get(k) for k in _PATCHES):
        return False
    return _replace_patch(to, "attn1") is None and _replace_patch(to, "attn2") is None


def _replace_patch(to, name):
    """The attention replace patch the host would call for this block ((block, index) first, then the
    block), or None."""
    r = (to.get("patches_replace") or {}).get(name) or {}
    block = to.get("block")
    here = (block[0], block[1], to.get("block_index", 0)) if block is not None else None
    return r.get(here) if here in r else r.get(block)


def _host_body(cls):
    """(source of the method holding the block's steps, whether it passes transformer_options to attn1)."""
    for method in ("forward", "_forward"):
        src = fm.host_source(cls, method, _PARAMS)
        if src and all(step in src for step in _STEPS) and any(add in src for add in _ADDS):
            return src, "value=value_attn1, transformer_options=transformer_options)" in src
    return None, False


def eligible(m):
    cls = fm.original_class(m)
    if cls.__name__ != "BasicTransformerBlock" or _host_body(cls)[0] is None:
        return False
    if getattr(m, "ff_in", True) or not getattr(m, "is_res", False) or getattr(m, "attn2", None) is None:
        return False
    # Forge's block has no temporal switch (nor reads one): absent, it is off
    if getattr(m, "disable_self_attn", True) or getattr(m, "switch_temporal_ca_to_sa", False):
        return False
    return all(fm.is_layer_norm(getattr(m, n, None)) for n in ("norm2", "norm3"))


def plan_transformer_blocks(root, prefix=""):
    """{prefix + path: stand-in} for every eligible BasicTransformerBlock of `root`; never modifies `root`.
    Put these before any patch of their children: ComfyUI sets a child's patch through its parent's path."""
    out = {}
    for name, mod in root.named_modules():
        if name and eligible(mod):
            fm.host_forwards(type(mod.norm2))    # norm2/norm3's forwards, as forward compares them
            new = fm.clone_as(FusedTransformerBlock, mod)
            new.sdaccel_attn_takes_options = _host_body(fm.original_class(mod))[1]
            out[prefix + name] = new
    return out
