"""UNet block streaming: the weights of some stream units live in (pinned) host memory and are copied into a
GPU ring buffer on a side stream just before they run, the next units' copies in flight while the current one
computes. Host-agnostic (no ComfyUI import); the host decides which tensors are off the GPU.

The unit ("block" below) is a stream unit of an ldm UNetModel in execution order (engine/memory/vram_plan.py's
`stream_units`: time_embed, label_emb, out, each ResBlock or up/downsampler of input_blocks.i, middle_block,
output_blocks.i, each transformer block). ComfyUI runs a TimestepEmbedSequential layer by layer rather than
through its __call__, so the trigger is a forward pre-hook on every module of a unit that owns tensors: the
first one that runs in a unit "enters" it.

Fixed places. Each streamed block gets a fixed place in one ring buffer (vram_plan.ring_layout) and its
tensors' `.data` point there for as long as the streamer is installed; the host copy of a block is one
pinned buffer with the same layout, so a block is one host-to-device copy. That buffer becomes the tensors'
host data for good (their `.data` views it after `remove()`): the model's own host copies are freed rather than
kept beside it, and the buffers are packed into pinned slabs (engine/memory/pinned_memory.py), so streaming holds about
the weights' own size in host memory. Because the addresses never change, a CUDA graph captured over a
step replays the copies too: the step then costs max(compute, transfer) instead of the eager step's Python
time plus whatever transfer it does not hide.

A step (s = the streamed blocks that have something off the device, d = prefetch depth):
  * the UNet's forward pre-hook starts the step: copies of s[0..d] are issued;
  * entering s[i]: s[i+d]'s copy is issued (any of s[i..i+d] not issued yet too; s[i] itself only when
    blocks ran out of order, a "demand load"), then the compute stream waits for s[i]'s copy;
  * the UNet's forward hook ends the step: the compute stream waits for the copy stream (a capture joins).
A copy first waits for an event recorded on the compute stream when it is issued, so it never overwrites a
place before the kernels issued so far (the place's previous reader among them) have read it; ring_layout
keeps a block's place clear of the d blocks before it, which are computing or in flight then.

Swapping is `tensor.data = view`: Parameter objects, names and state_dict keys stay as they were (LoRA and
weight patches keep working); `remove()` puts every tensor's original data back and frees the ring. While
installed the unet carries a residency token (engine/memory/residency.py), a new one per install, which the
weights fingerprint reads: graphs captured against another ring or other host buffers are never replayed.
Through it, a host that converts conv weights to channels_last in place reaches `relayout` for the streamed
ones.

With device=cpu the same logic runs with real copies into a CPU ring and no streams: the order, the
aliasing of places and the swaps are testable without a GPU.
"""
import contextlib

import torch

from . import host_mirror, residency
from .pinned_memory import aligned as _aligned, host_buffers, nbytes as _nbytes, view_as as _view
from .vram_plan import ring_layout, stream_units

def _modules(unit):
    """Every module under a unit (a module or a list of them), each once."""
    seen = set()
    for root in (unit if isinstance(unit, (list, tuple)) else [unit]):
        for m in root.modules():
            if id(m) not in seen:
                seen.add(id(m))
                yield m


def owned_tensors(unit):
    """(owner, tensor) for every parameter and buffer under `unit` (a module or a list of them), each once."""
    seen, out = set(), []
    for m in _modules(unit):
        for d in (m._parameters, m._buffers):
            for t in d.values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((m, t))
    return out


def off_device_bytes(unet, device):
    """{unit name: bytes of its tensors not on `device`} for the stream units, execution order."""
    device = torch.device(device)
    return {name: sum(_nbytes(t) for _, t in owned_tensors(mod) if not _on(t, device)) for name, mod in stream_units(unet)}


def on_device_bytes(module, device):
    """Bytes of the parameters and buffers under `module` that are on `device`."""
    device = torch.device(device)
    return sum(_nbytes(t) for _, t in owned_tensors(module) if _on(t, device))


def _on(t, device):
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


class _Block:
    __slots__ = ("name", "tensors", "hosts", "offsets", "nbytes", "host_flat", "place")

    def __init__(self, name):
        self.name, self.tensors, self.hosts, self.offsets = name, [], [], []
        self.nbytes, self.host_flat, self.place = 0, None, 0


class BlockStreamer:
    """Streams the tensors of the `streamed` stream units of `unet` to `device` (see the module doc).

    streamed: block names (any order; execution order is used). On a CUDA device only the tensors of those
    blocks that are not already on the device move (the host decides placement), unless `every_tensor`
    (tests); on CPU all of them are copied, so the logic can be tested. pinned_cache: a dict reused across
    installs so a block's host buffer is built (and pinned) once, keyed by its tensors' pointers (views of it),
    shapes, strides and dtypes.
    `prefetch_log`: [(issued block, block computing then | None at the step's start)].
    """

    def __init__(self, unet, streamed, prefetch_depth=1, device="cuda", pin=None, pinned_cache=None,
                 every_tensor=False):
        if prefetch_depth < 0:
            raise ValueError("prefetch_depth must be >= 0, got %r" % (prefetch_depth,))
        self.unet, self.device, self.depth = unet, torch.device(device), int(prefetch_depth)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.blocks = stream_units(unet)
        names = [n for n, _ in self.blocks]
        unknown = set(streamed) - set(names)
        if unknown:
            raise ValueError("not stream units of this UNet: %s" % ", ".join(sorted(unknown)))
        self.streamed = [n for n in names if n in set(streamed)]
        self.cuda = self.device.type == "cuda"
        self.every_tensor = bool(every_tensor) or not self.cuda
        self.pin = (self.cuda and torch.cuda.is_available()) if pin is None else bool(pin)
        self.pinned_cache = pinned_cache if pinned_cache is not None else {}
        self.prefetch_log, self.installed = [], False
        self.stats = {"copies": 0, "bytes_copied": 0, "demand_loads": 0, "steps": 0}
        self._handles, self._state, self._active = [], {}, []
        self._copy_stream, self.ring = None, None
        self._issued, self._current, self._open, self._where = {}, None, False, {}

    # -- install / remove -------------------------------------------------------------------------------
    def install(self):
        if self.installed:
            return self
        for name, mod in self.blocks:
            if name not in self.streamed:
                continue
            b = _Block(name)
            b.tensors = [t for _, t in owned_tensors(mod) if self.every_tensor or not _on(t, self.device)]
            b.hosts = [t.data for t in b.tensors]
            b.offsets, b.nbytes = _layout(b.tensors)
            self._state[name] = b
        self._active = [n for n in self.streamed if self._state[n].tensors]
        self._apos = {n: i for i, n in enumerate(self._active)}
        places, ring = ring_layout([self._state[n].nbytes for n in self._active], self.depth)
        new_cache = {}
        active = [self._state[n] for n in self._active]
        # each block's tensors in one host buffer with the ring's layout (pinned when streaming to a GPU); their
        # host data become views of it, so the model's own host copies are freed, not duplicated
        flats = host_flats([(b.hosts, b.offsets, b.nbytes) for b in active], self.pin,
                           self.pinned_cache, new_cache)
        for b, place, (flat, views) in zip(active, places, flats):
            _adopt(b.tensors, b.hosts, views)
            b.place, b.host_flat, b.hosts = place, flat, views
        self.pinned_cache.clear()
        self.pinned_cache.update(new_cache)
        self.ring = torch.empty(ring, dtype=torch.uint8, device=self.device)
        self._where = {}
        for n in self._active:
            b = self._state[n]
            for i, (t, host, off) in enumerate(zip(b.tensors, b.hosts, b.offsets)):
                t.data = _view(self.ring, b.place + off, host)
                self._where[id(t)] = (b, i)
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        for name, mod in self.blocks:
            hook = self._make_hook(name)
            for m in _modules(mod):
                if any(v is not None for v in m._parameters.values()) or any(v is not None for v in m._buffers.values()):
                    self._handles.append(m.register_forward_pre_hook(hook))
        self._handles.append(self.unet.register_forward_pre_hook(lambda m, a: self._step_start()))
        self._handles.append(self.unet.register_forward_hook(lambda m, a, o: self._step_end()))
        residency.mark(self.unet, self)
        self.installed, self._current, self._issued = True, None, {}
        return self

    def remove(self):
        """Puts every streamed tensor's original data back, drops the hooks and frees the ring. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for b in self._state.values():
            for t, host in zip(b.tensors, b.hosts):
                t.data = host
        if self.installed and self._copy_stream is not None:
            # the ring is freed below: nothing may still be copying into it
            try:
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            except RuntimeError:   # the copy stream was left in a failed capture: it copies nothing any more
                pass
        residency.clear(self.unet)
        self._state, self._current, self._active, self._issued, self.installed = {}, None, [], {}, False
        self._open, self._where = False, {}
        self._copy_stream, self.ring = None, None
        return self

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.remove()
        return False

    @property
    def streamed_bytes(self):
        """Bytes copied to the device per step (blocks with nothing off the device are skipped)."""
        return sum(self._state[n].nbytes for n in self._active)

    @property
    def ring_bytes(self):
        """Bytes of the GPU ring the streamed blocks take turns in (0 when not installed)."""
        return 0 if self.ring is None else self.ring.numel()

    def relayout(self, t, memory_format):
        """Stores streamed tensor `t` in `memory_format` (values unchanged), where a host converts layouts in
        place (engine/patching.convert_conv_weights): its host copy is converted (and stays so after
        remove(), so later runs start from it), its bytes in the block's host buffer rewritten, and `t` viewed
        over its place in the ring with the new strides. Called between steps, not inside one. False when
        `t` is not streamed here."""
        loc = self._where.get(id(t)) if self.installed else None
        if loc is None:
            return False
        b, i = loc
        host = b.hosts[i]
        if not host.is_contiguous(memory_format=memory_format):
            converted = host.contiguous(memory_format=memory_format)    # a copy: the view is overwritten next
            place = _view(b.host_flat, b.offsets[i], converted)
            place.copy_(converted)
            # a host tensor is the buffer's view (see host_flat); a device one (tests) keeps its own data
            host = b.hosts[i] = place if host.device.type == "cpu" else converted
        t.data = _view(self.ring, b.place + b.offsets[i], host)
        self._issued = {}                  # a copy issued before holds the old layout
        return True

    def live_blocks(self):
        """Names of the streamed blocks whose copies were issued in this step and not overwritten since."""
        return [n for n in self._active if n in self._issued]

    # -- internals ---------------------------------------------------------------------------------------
    def _make_hook(self, name):
        def pre_hook(module, args):
            if self._current != name:
                self._enter(name)
        return pre_hook

    def _step_start(self):
        self.stats["steps"] += 1
        if self._open and self.cuda:
            # the last step never ended (an error, or a graph capture that failed and left the copy stream in
            # its invalidated capture): continue on a fresh copy stream
            self._copy_stream = torch.cuda.Stream(device=self.device)
        self._open = True
        self._current, self._issued = None, {}
        for n in self._active[:1 + self.depth]:
            self._issue(n, None)

    def _step_end(self):
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        self._open, self._current, self._issued = False, None, {}

    def _issue(self, name, computing):
        b = self._state[name]
        lo, hi = b.place, b.place + b.nbytes
        for other in list(self._issued):      # a place overwritten: that copy is gone (out-of-order calls)
            o = self._state[other]
            if other != name and o.place < hi and lo < o.place + o.nbytes:
                del self._issued[other]
        self.prefetch_log.append((name, computing))
        dst = self.ring[lo:hi]
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            free = torch.cuda.Event()
            free.record(compute)                   # the place's previous readers are issued before this
            self._copy_stream.wait_event(free)
            with torch.cuda.stream(self._copy_stream):
                dst.copy_(b.host_flat, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            self._issued[name] = done
        else:
            dst.copy_(b.host_flat)
            self._issued[name] = True
        self.stats["copies"] += 1
        self.stats["bytes_copied"] += b.nbytes

    def _enter(self, name):
        self._current = name
        i = self._apos.get(name)
        if i is None:
            return                                  # a resident block (or nothing of it off the device)
        for j, n in enumerate(self._active[i:i + 1 + self.depth]):
            if n not in self._issued:
                if j == 0 and self.depth:
                    self.stats["demand_loads"] += 1
                self._issue(n, name)
        done = self._issued[name]
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(done)


def host_flats(blocks, pin, cache, new_cache):
    """Each block's host tensors in one uint8 host buffer. `blocks`: [(hosts, offsets, nbytes)] with `hosts[i]`
    the current host data of one of the block's tensors, placed at byte `offsets[i]` of a buffer of `nbytes`.
    Returns [(buffer, views)] per block: `views[i]` holds hosts[i]'s values in the buffer, for the caller to use
    as the tensor's host data from now on, so the model's own copies are freed rather than kept beside the
    pinned ones (a block with device tensors, the tests' stream-every-block switch, keeps its hosts). The
    buffers built here are allocated together (pinned and packed when `pin`: engine/memory/pinned_memory.py); a
    block whose hosts are already views of a buffer in `cache` (keyed by their pointers, valid while the cache
    or a view keeps the buffer alive) reuses it. Every buffer used is entered in `new_cache` (the caller swaps
    caches, so buffers no longer used are dropped)."""
    on_host = [all(h.device.type == "cpu" for h in hosts) for hosts, _, _ in blocks]
    out, build = [None] * len(blocks), []
    for k, (hosts, _, nbytes) in enumerate(blocks):
        flat = cache.get(_key(hosts)) if on_host[k] else None
        if flat is not None and flat.numel() == nbytes:
            out[k] = flat
        else:
            build.append(k)
    for k, flat in zip(build, host_buffers([blocks[k][2] for k in build], pin)):
        for host, off in zip(blocks[k][0], blocks[k][1]):
            _view(flat, off, host).copy_(host)
        out[k] = flat
    result = []
    for (hosts, offsets, _), flat, host_only in zip(blocks, out, on_host):
        if not host_only:
            # a device tensor's pointer may be reused with other contents: such a block is built every time
            result.append((flat, list(hosts)))
            continue
        views = [_view(flat, off, host) for host, off in zip(hosts, offsets)]
        new_cache[_key(views)] = flat
        result.append((flat, views))
    return result


def _adopt(tensors, hosts, views):
    """A host mirror's copy of a tensor the buffer now holds is dropped (engine/host_mirror.adopt): after a
    full load the mirror copied every weight off the GPU, the streamed ones included."""
    for t, host, view in zip(tensors, hosts, views):
        if view.data_ptr() != host.data_ptr():
            host_mirror.adopt(t, host, view)


def _layout(tensors):
    """(byte offset of each tensor, total bytes) of `tensors` laid out one after another, each place aligned:
    a block's layout in its host buffer and in its ring place alike."""
    offsets, n = [], 0
    for t in tensors:
        offsets.append(n)
        n += _aligned(_nbytes(t))
    return offsets, n


def _key(hosts):
    # no version counters: a cache hit means `hosts` are views of that very buffer, so a host's in-place
    # write (a weight patch) is already in it; a replaced tensor has another pointer and rebuilds the buffer
    return tuple((h.data_ptr(), tuple(h.shape), tuple(h.stride()), h.dtype) for h in hosts)


@contextlib.contextmanager
def resident_blocks(device, unet, names, pinned_cache=None):
    """The off-device tensors of UNet blocks `names` given GPU copies for the scope (the VRAM Pool's promoted
    blocks), their host data put back after. With `pinned_cache` (a dict kept across runs, as the streamer's)
    each block's copy comes from one pinned host buffer built on its first run: ~50 GB/s instead of the
    ~9 GB/s of a copy from pageable memory (SDXL at a 4 GiB budget promotes ~0.9 GiB per run). A tensor the run
    converted to channels_last leaves its host data converted too (put_back), so later runs, which do not
    convert again, keep the layout."""
    moved = []
    blocks = dict(stream_units(unet))
    per_block = [[t for _, t in owned_tensors(blocks[name]) if not _on(t, device)] for name in names]
    per_block = [ts for ts in per_block if ts]
    try:
        if pinned_cache is not None and torch.device(device).type == "cuda":
            new_cache = {}
            items = [([t.data for t in tensors], *_layout(tensors)) for tensors in per_block]
            # the pinned views are the host data from now on (the model's own copies freed, not duplicated)
            hosts = [views for _, views in host_flats(items, True, pinned_cache, new_cache)]
            for tensors, (old, _, _), views in zip(per_block, items, hosts):
                _adopt(tensors, old, views)
            pinned_cache.clear()
            pinned_cache.update(new_cache)
        else:
            hosts = [[t.data for t in tensors] for tensors in per_block]
        for tensors, views in zip(per_block, hosts):
            for t, host in zip(tensors, views):
                moved.append((t, host))       # first: an out-of-memory below still puts it back
                t.data = host.to(device, non_blocking=host.is_pinned())    # keeps a dense host's strides
        yield len(moved)
    finally:
        for t, host in moved:
            put_back(t, host)


def put_back(t, host):
    """t.data = host, converting host to channels_last first when the run converted t's copy."""
    if (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
            and not host.is_contiguous(memory_format=torch.channels_last)):
        host = host.contiguous(memory_format=torch.channels_last)
    t.data = host

