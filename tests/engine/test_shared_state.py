"""A host's marks on a module's weight state (ComfyUI's `comfy_patched_weights`) shared between the module and its
stand-ins, which share its weights: set, read and cleared through either, as ComfyUI does on whichever of the two
is in the tree; every other module of the class keeps the mark as a plain attribute of its own."""
from torch import nn

from sd_accel.engine.patches import fused_modules as fm
from sd_accel.engine.patches import shared_state

MARK = "comfy_patched_weights"


class _Norm(nn.GroupNorm):   # a host's class, as ComfyUI's ops subclass torch's
    pass


def test_a_mark_set_or_cleared_on_either_is_seen_on_both():
    shared_state.share((MARK,))
    orig, other = _Norm(2, 4), _Norm(2, 4)
    setattr(orig, MARK, True)                      # patched while the original was in the tree
    setattr(other, MARK, True)
    standin = fm.clone_as(fm.FusedGroupNorm, orig)
    assert getattr(standin, MARK) is True and standin._parameters is orig._parameters
    delattr(orig, MARK)                           # the host restored the weights through the original
    assert not hasattr(standin, MARK), "the stand-in would skip patching weights no longer patched"
    setattr(standin, MARK, True)                  # patched through the stand-in
    assert getattr(orig, MARK) is True, "stock's next load would patch the patched weights again"
    again = fm.clone_as(fm.FusedGroupNorm, standin)   # a stand-in planned from a stand-in
    delattr(again, MARK)
    assert not hasattr(orig, MARK) and not hasattr(standin, MARK)
    assert getattr(other, MARK) is True and other.__dict__[MARK] is True   # a plain attribute elsewhere
    delattr(other, MARK)
    assert not hasattr(other, MARK)
    assert sorted(orig.state_dict()) == sorted(standin.state_dict()) == ["bias", "weight"]
