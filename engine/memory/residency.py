"""The weights-residency token: how a module says that its weights live where a fingerprint cannot see them.

A CUDA graph replays a step only while the weights fingerprint (engine/graphs/fingerprint.py) is unchanged: the
Parameter objects, their storage addresses and version counters. Something that moves a module's weights
without changing any of those must change the module's token instead: a block streamer
(engine/memory/offload.py) points the weights' `.data` at fixed places of its GPU ring, so it marks the module
with a new token at every install and clears it on remove, and a graph captured against another ring or other
host buffers is never replayed. Tokens compare by identity only.

The token also names its streamer, which offers `relayout(tensor, memory_format) -> bool` (False: not one of
its tensors), for code that changes a weight's layout in place: the streamer's copy in the ring and on the host
must change with it (engine/patches/patching.py: convert_conv_weights). While a module carries a token its
weights may not all be where they live between runs (engine/patches/emb_projections.py reads them per block).

A leaf module: it imports nothing, so patches/, graphs/ and memory/ can all use it.
"""
_ATTR = "sd_accel_weights_token"      # an instance attribute: it lives and dies with the module


class Token:
    """One placement of a module's weights: a new object per mark, carrying who placed them."""
    __slots__ = ("streamer",)

    def __init__(self, streamer=None):
        self.streamer = streamer


def mark(module, streamer=None):
    """Gives `module` a new token (its weights moved where a fingerprint cannot see) and returns it."""
    token = Token(streamer)
    setattr(module, _ATTR, token)
    return token


def clear(module):
    """Removes `module`'s token (its weights are back where the fingerprint sees them). Idempotent."""
    if hasattr(module, _ATTR):
        delattr(module, _ATTR)


def token_of(module):
    """`module`'s current token, or None."""
    return getattr(module, _ATTR, None)


def streamer_of(module):
    """The streamer holding `module`'s weights (see the module doc), or None."""
    return getattr(token_of(module), "streamer", None)
