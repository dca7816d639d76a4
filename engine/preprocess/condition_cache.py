"""Persistent, content-addressed disk cache of ControlNet condition maps (canny, depth, pose, ...).

One entry is one frame: a `.pt` file holding a uint8 map (H, W) for single-channel maps or
(H, W, 3) for colour maps, plus plain string/int metadata. A ComfyUI IMAGE is rebuilt from it
exactly as `u8.float() / 255`, so a hit is bit-identical to the miss that wrote it.

Key: sha256 over the source pixels and a "spec" of everything else that changes the output
(engine/preprocess/cache_keys.py). A batch of frames goes through the cache in engine/preprocess/batch.py.

Safety: files are written to a temp file in the cache folder and `os.replace`d into place, so a
reader never sees a partial entry. Entries are read with `torch.load(weights_only=True)` (no code
runs from a hostile pickle) and validated; a bad entry is logged in one line, deleted and recomputed.
A size cap evicts least-recently-used entries (by access time); eviction and `clear()` only touch
`<64 hex>.pt` entries and this module's own temp files in the cache folder itself.

Host-agnostic: nothing here imports ComfyUI; the node layer picks the folder.
"""
from __future__ import annotations

import io
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ...kernels.errors import first_line
from .cache_keys import CACHE_FORMAT_VERSION

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 2 * 1024 ** 3
ENV_DIR = "SDACCEL_CONDITION_CACHE_DIR"
ENV_MAX_MB = "SDACCEL_CONDITION_CACHE_MAX_MB"
MAX_ENTRY_FILE_BYTES = 256 * 1024 ** 2  # refuse to read anything bigger: no legit map is near this

_ENTRY_RE = re.compile(r"^[0-9a-f]{64}\.pt$")
_TMP_RE = re.compile(r"^\.[0-9a-f]{64}\.[A-Za-z0-9_]+\.tmp$")
_STALE_TMP_SECONDS = 3600
_ENTRY_FIELDS = {"format", "key", "kind", "map", "height", "width", "channels"}


# ---------------------------------------------------------------------------------- conversions
def maps_to_image(maps: Sequence[torch.Tensor]) -> torch.Tensor:
    """uint8 maps ((H, W) or (H, W, 3)) -> ComfyUI IMAGE float32 [B, H, W, 3] as u8.float() / 255."""
    frames = []
    for m in maps:
        f = m.float() / 255
        if f.ndim == 2:
            f = f.unsqueeze(-1).expand(*f.shape, 3)
        frames.append(f)
    return torch.stack(frames).contiguous()


def as_u8_map(m) -> torch.Tensor:
    """Accept a numpy array or tensor map; return a contiguous CPU uint8 tensor (H, W) or (H, W, 3)."""
    t = torch.as_tensor(m)
    if t.dtype != torch.uint8:
        raise TypeError(f"condition maps must be uint8, got {t.dtype}")
    if t.ndim == 3 and t.shape[-1] == 1:
        t = t[..., 0]
    if not (t.ndim == 2 or (t.ndim == 3 and t.shape[-1] == 3)):
        raise ValueError(f"condition map must be (H, W) or (H, W, 3), got {tuple(t.shape)}")
    return t.cpu().contiguous()


# ----------------------------------------------------------------------------------------- cache
@dataclass
class CacheStats:
    directory: str
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    writes: int
    rejected: int
    evicted: int

    def as_text(self) -> str:
        mib = self.bytes / 1024 ** 2
        cap = self.max_bytes / 1024 ** 2
        total = self.hits + self.misses
        rate = f"{100.0 * self.hits / total:.0f}%" if total else "n/a"
        return (f"location: {self.directory}\n"
                f"size: {mib:.1f} MiB of {cap:.0f} MiB cap, {self.entries} entries\n"
                f"this session: {self.hits} hits, {self.misses} misses (hit rate {rate}), "
                f"{self.writes} writes, {self.rejected} rejected, {self.evicted} evicted")


class ConditionCache:
    """A folder of `<key>.pt` condition maps with an LRU size cap. Thread-safe; process-safe writes."""

    def __init__(self, directory: str, max_bytes: int = DEFAULT_MAX_BYTES):
        self.directory = os.path.abspath(directory)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._bytes: int | None = None  # running estimate; rescanned when eviction may be needed
        self._touch_ns = 0
        self.hits = self.misses = self.writes = self.rejected = self.evicted = 0

    # -- paths
    def path_for(self, key: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"not a condition-cache key: {key!r}")
        return os.path.join(self.directory, key + ".pt")

    # -- read
    def get(self, key: str, expect_hw: tuple[int, int] | None = None,
            expect_channels: int | None = None) -> torch.Tensor | None:
        """The cached uint8 map for `key`, or None (missing, or rejected and deleted). Counts a hit/miss."""
        path = self.path_for(key)
        result = self._read(path, key, expect_hw, expect_channels)
        with self._lock:
            if result is None:
                self.misses += 1
            else:
                self.hits += 1
        if result is not None:
            self._touch(path)
        return result

    def _read(self, path, key, expect_hw, expect_channels):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("[SD Accel] condition cache: cannot open %s (%s); recomputing", path, e)
            return None
        try:
            st = os.fstat(fd)
            if st.st_size > MAX_ENTRY_FILE_BYTES:
                reason = f"file too large ({st.st_size} bytes)"
                data = None
            else:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    data = f.read()
                reason = None
        finally:
            os.close(fd)
        if data is not None:
            try:
                obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                return self._validate(obj, key, expect_hw, expect_channels)
            except Exception as e:  # noqa: BLE001 - any failure to load or validate means "bad entry"
                reason = f"{type(e).__name__}: {first_line(e)}"
        self._reject(path, st, reason)
        return None

    @staticmethod
    def _validate(obj, key, expect_hw, expect_channels) -> torch.Tensor:
        if type(obj) is not dict:
            raise ValueError(f"entry is a {type(obj).__name__}, not a dict")
        if set(obj) != _ENTRY_FIELDS:
            raise ValueError(f"entry fields {sorted(map(str, obj))} != {sorted(_ENTRY_FIELDS)}")
        for k, v in obj.items():
            if k == "map":
                if type(v) is not torch.Tensor:
                    raise ValueError(f"map is a {type(v).__name__}, not a plain tensor")
            elif type(v) not in (str, int):
                raise ValueError(f"metadata {k!r} is a {type(v).__name__}, not str/int")
        if obj["format"] != CACHE_FORMAT_VERSION:
            raise ValueError(f"format {obj['format']} != {CACHE_FORMAT_VERSION}")
        if obj["key"] != key:
            raise ValueError("stored key does not match the requested key")
        m = obj["map"]
        if m.dtype != torch.uint8:
            raise ValueError(f"map dtype {m.dtype} is not uint8")
        c = obj["channels"]
        want_shape = (obj["height"], obj["width"]) if c == 1 else (obj["height"], obj["width"], c)
        if c not in (1, 3) or tuple(m.shape) != want_shape:
            raise ValueError(f"map shape {tuple(m.shape)} does not match metadata {want_shape}")
        if expect_hw is not None and tuple(m.shape[:2]) != tuple(expect_hw):
            raise ValueError(f"map size {tuple(m.shape[:2])} != expected {tuple(expect_hw)}")
        if expect_channels is not None and c != expect_channels:
            raise ValueError(f"map has {c} channels, expected {expect_channels}")
        return m.contiguous()

    def _reject(self, path, st, reason):
        with self._lock:
            self.rejected += 1
        log.warning("[SD Accel] condition cache: rejected bad entry %s (%s); deleted, recomputing",
                    path, reason)
        try:  # delete only the file we read, not a fresh one another writer just replaced it with
            now = os.stat(path)
            if (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns):
                os.remove(path)
        except OSError:
            pass

    def _touch(self, path):
        with self._lock:  # strictly increasing stamps so LRU order is exact even within a tick
            self._touch_ns = max(time.time_ns(), self._touch_ns + 1000)
            ns = self._touch_ns
        try:
            os.utime(path, ns=(ns, ns))
        except OSError:
            pass

    # -- write
    def put(self, key: str, u8_map, kind: str = "") -> bool:
        """Store one uint8 map atomically. Returns False when not stored (too big for the cap, I/O error)."""
        m = as_u8_map(u8_map)
        entry = {"format": CACHE_FORMAT_VERSION, "key": key, "kind": str(kind), "map": m,
                 "height": int(m.shape[0]), "width": int(m.shape[1]),
                 "channels": 1 if m.ndim == 2 else int(m.shape[2])}
        buf = io.BytesIO()
        torch.save(entry, buf)
        data = buf.getvalue()
        if len(data) > self.max_bytes:
            return False
        path = self.path_for(key)
        try:
            os.makedirs(self.directory, exist_ok=True)
            try:
                old = os.stat(path).st_size
            except OSError:
                old = 0
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
                raise
        except PermissionError as e:
            if os.name == "nt":  # a reader holds the target open; the other writer's identical entry stands
                return False
            log.warning("[SD Accel] condition cache: cannot write %s (%s)", path, e)
            return False
        except OSError as e:
            log.warning("[SD Accel] condition cache: cannot write %s (%s)", path, e)
            return False
        self._touch(path)
        with self._lock:
            self.writes += 1
            if self._bytes is not None:
                self._bytes += len(data) - old
            over = self._bytes is None or self._bytes > self.max_bytes
        if over:
            self.evict()
        return True

    # -- size management
    def _scan(self) -> list[tuple[int, str, int]]:
        """[(access ns, path, size)] of this cache's entries; also removes its own stale temp files."""
        out = []
        try:
            it = os.scandir(self.directory)
        except FileNotFoundError:
            return out
        now = time.time()
        with it:
            for e in it:
                try:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    if _ENTRY_RE.match(e.name):
                        st = e.stat(follow_symlinks=False)
                        out.append((max(st.st_atime_ns, st.st_mtime_ns), e.path, st.st_size))
                    elif _TMP_RE.match(e.name):
                        if now - e.stat(follow_symlinks=False).st_mtime > _STALE_TMP_SECONDS:
                            os.remove(e.path)
                except OSError:
                    continue
        return out

    def evict(self, max_bytes: int | None = None) -> int:
        """Delete least-recently-used entries until the total is at most the cap. Returns count deleted."""
        cap = self.max_bytes if max_bytes is None else int(max_bytes)
        entries = sorted(self._scan())
        total = sum(s for _, _, s in entries)
        removed = 0
        for _, path, size in entries:
            if total <= cap:
                break
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            removed += 1
        with self._lock:
            self._bytes = total
            self.evicted += removed
        return removed

    def set_max_bytes(self, max_bytes: int) -> int:
        """Change the cap and evict down to it at once. Returns the number of entries evicted."""
        self.max_bytes = int(max_bytes)
        return self.evict()

    def clear(self) -> tuple[int, int]:
        """Delete every entry (and stale temp file) this cache owns. Returns (entries, bytes) removed."""
        n = b = 0
        for _, path, size in self._scan():
            try:
                os.remove(path)
                n += 1
                b += size
            except OSError:
                pass
        with self._lock:
            self._bytes = None
        return n, b

    def total_bytes(self, rescan: bool = False) -> int:
        with self._lock:
            known = self._bytes
        if known is None or rescan:
            known = sum(s for _, _, s in self._scan())
            with self._lock:
                self._bytes = known
        return known

    def stats(self) -> CacheStats:
        entries = self._scan()
        total = sum(s for _, _, s in entries)
        with self._lock:
            self._bytes = total
            return CacheStats(self.directory, len(entries), total, self.max_bytes, self.hits,
                              self.misses, self.writes, self.rejected, self.evicted)


# -------------------------------------------------------------------------- shared instances
_shared: dict[str, ConditionCache] = {}
_shared_lock = threading.Lock()


def default_cache_dir(base_dir: str | None = None) -> str:
    """`$SDACCEL_CONDITION_CACHE_DIR`, else `<base_dir>/sd_accel/condition_cache` (base: the host's
    user folder; the system temp folder when the host gives none)."""
    env = os.environ.get(ENV_DIR, "").strip()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(base_dir or tempfile.gettempdir(), "sd_accel", "condition_cache")


def default_max_bytes() -> int:
    env = os.environ.get(ENV_MAX_MB, "").strip()
    if env:
        try:
            return max(0, int(float(env) * 1024 ** 2))
        except ValueError:
            log.warning("[SD Accel] condition cache: ignoring %s=%r (not a number)", ENV_MAX_MB, env)
    return DEFAULT_MAX_BYTES


def shared_cache(directory: str, max_bytes: int | None = None) -> ConditionCache:
    """One ConditionCache per folder per process, so hit/miss counts add up across nodes."""
    key = os.path.normcase(os.path.abspath(directory))
    with _shared_lock:
        cache = _shared.get(key)
        if cache is None:
            cache = _shared[key] = ConditionCache(directory, default_max_bytes())
    if max_bytes is not None and int(max_bytes) != cache.max_bytes:
        cache.set_max_bytes(max_bytes)
    return cache
