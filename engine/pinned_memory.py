"""Page-locked host buffers of exactly the size asked for. Host-agnostic (no ComfyUI import).

`torch.empty(n, pin_memory=True)` goes through torch's caching host allocator, which rounds every request up
to the next power of two: an SDXL transformer block's 70 MB of weights pins 128 MB, and the pinned copies of
a streamed SDXL UNet took ~1.6x their size. Here a large buffer is ordinary (pageable) host memory from
torch's CPU allocator, a few pages larger than asked, whose whole pages are then registered with the CUDA
driver (`cudaHostRegister`): transfers from it run at pinned speed and CUDA graphs can capture them, and the
host memory it takes is its size. The registration is undone when the buffer's storage is freed (the last
tensor viewing it gone: torch keeps a storage's Python object alive as long as its memory is, so a
finalizer on it runs then), as torch's own checkpoint stager does.

As with any pinned buffer, a caller must not drop the last view of one while a copy from it is in flight
(torch's caching allocator would delay the reuse; here the memory goes back to the CPU allocator at once).
The streamer's buffers are read only by its own copies, which `remove()` waits for.

Small buffers (< EXACT_MIN_BYTES), where rounding costs little, and hosts where registering fails (no CUDA
driver, a locked-memory limit) take torch's pinned allocator, and pageable memory after that: a slower copy,
never an error.
"""
import logging
import threading
import weakref

import torch

log = logging.getLogger("sd_accel")

EXACT_MIN_BYTES = 1 << 20       # below this, torch's rounding wastes at most 1 MiB per buffer
PAGE = 4096
_REGISTER_PORTABLE = 1          # cudaHostRegisterPortable: pinned for every CUDA context, as torch's own

_lock = threading.Lock()
_registered = {"bytes": 0, "buffers": 0}
_warned = []


def registered_bytes():
    """Host bytes currently page-locked through this module (for reports and tests)."""
    return _registered["bytes"]


def _unregister(ptr, nbytes):
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown or a lost driver: the OS reclaims it anyway
        pass
    with _lock:
        _registered["bytes"] -= nbytes
        _registered["buffers"] -= 1


def _register(ptr, nbytes):
    """True when [ptr, ptr + nbytes) is now page-locked."""
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE))
    except Exception as e:  # noqa: BLE001 - no CUDA runtime here
        rc = repr(e)
    if rc == 0:
        return True
    if not _warned:
        _warned.append(rc)
        log.warning("SD Accel: page-locking host memory failed (cudaHostRegister: %s); large pinned buffers "
                    "come from torch's pinned allocator (rounded up to a power of two) instead", rc)
    return False


def empty_pinned(nbytes):
    """A uint8 host tensor of exactly `nbytes`, page-locked where possible (see the module doc)."""
    nbytes = int(nbytes)
    if nbytes >= EXACT_MIN_BYTES and torch.cuda.is_available() and not _warned:
        raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE               # the first page boundary inside raw
        locked = (nbytes + PAGE - 1) // PAGE * PAGE  # whole pages only: no page is shared with another buffer
        ptr = raw.data_ptr() + start
        if _register(ptr, locked):
            with _lock:
                _registered["bytes"] += locked
                _registered["buffers"] += 1
            weakref.finalize(raw.untyped_storage(), _unregister, ptr, locked)
            return raw[start:start + nbytes]
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    except RuntimeError:            # the pinned-memory limit of this host: pageable
        return torch.empty(nbytes, dtype=torch.uint8)


def empty_host(nbytes, pin):
    """`empty_pinned(nbytes)` when `pin`, else pageable host memory."""
    return empty_pinned(nbytes) if pin else torch.empty(int(nbytes), dtype=torch.uint8)
