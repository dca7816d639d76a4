"""Condition-map disk cache: keys (engine/preprocess/cache_keys.py), exact round trip, batches
(engine/preprocess/batch.py), LRU eviction, bad files, concurrency (engine/preprocess/condition_cache.py)."""
import io
import logging
import os
import pickle
import threading

import pytest
import torch

from sd_accel.engine.preprocess import cache_keys, condition_cache as cc
from sd_accel.engine.preprocess.batch import map_batch
from sd_accel.engine.preprocess.cache_keys import file_identity, frame_key
from sd_accel.engine.preprocess.condition_cache import ConditionCache, maps_to_image

SPEC = {"preprocessor": "test", "implementation": "unit", "params": {"a": 1, "b": 0.5}}


def _u8(h=32, w=48, c=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (h, w) if c == 1 else (h, w, c)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def _key(i):
    return f"{i:064x}"


def _image(b=1, h=32, w=48, seed=0):
    return torch.rand(b, h, w, 3, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ keys
def test_key_depends_on_pixels_shape_dtype_and_every_spec_field(tmp_path):
    img = _image()[0]
    k = frame_key(img, SPEC)
    assert k == frame_key(img.clone(), dict(reversed(list(SPEC.items()))))  # canonical JSON
    nudged = img.clone()
    nudged[3, 4, 1] = torch.nextafter(nudged[3, 4, 1], torch.tensor(2.0))
    assert frame_key(nudged, SPEC) != k
    assert frame_key(img.to(torch.float64), SPEC) != k
    assert frame_key(img.reshape(48, 32, 3), SPEC) != k
    for change in ({"params": {"a": 2, "b": 0.5}}, {"implementation": "other"},
                   {"preprocessor": "x"}, {"libs": {"cv2": "5"}}):
        assert frame_key(img, {**SPEC, **change}) != k
    w = tmp_path / "weights.onnx"
    w.write_bytes(b"abc")
    k1 = frame_key(img, {**SPEC, "weights": file_identity(str(w))})
    os.utime(w, ns=(1, 1))
    assert frame_key(img, {**SPEC, "weights": file_identity(str(w))}) != k1


def test_key_includes_format_version(monkeypatch):
    img = _image()[0]
    k = frame_key(img, SPEC)
    monkeypatch.setattr(cache_keys, "CACHE_FORMAT_VERSION", cache_keys.CACHE_FORMAT_VERSION + 1)
    assert frame_key(img, SPEC) != k


def test_non_contiguous_frame_hashes_like_its_contiguous_copy():
    img = _image(h=40, w=40)[0]
    view = img.transpose(0, 1)
    assert frame_key(view, SPEC) == frame_key(view.contiguous(), SPEC)


def test_folder_identity_covers_every_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"1234")
    a = file_identity(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text("{}")
    assert file_identity(str(tmp_path)) != a


# ------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("channels", [1, 3])
def test_put_get_round_trip_is_exact(tmp_path, channels):
    cache = ConditionCache(str(tmp_path))
    m = _u8(c=channels)
    assert cache.put(_key(1), m, kind="test")
    got = cache.get(_key(1), expect_hw=(32, 48), expect_channels=channels)
    assert got.dtype == torch.uint8 and torch.equal(got, m)
    img = maps_to_image([got])
    assert img.shape == (1, 32, 48, 3) and img.dtype == torch.float32
    ref = m.float() / 255
    assert torch.equal(img[0], ref.unsqueeze(-1).expand(32, 48, 3) if channels == 1 else ref)
    assert cache.hits == 1 and cache.misses == 0
    assert cache.get(_key(2)) is None and cache.misses == 1


def test_map_batch_hit_is_bit_identical_and_per_frame(tmp_path):
    cache = ConditionCache(str(tmp_path))
    img = _image(b=3)
    calls = []

    def compute(idx):
        calls.append(list(idx))
        return [(img[i, ..., 0] * 255).round().to(torch.uint8) for i in idx]

    out1, r1 = map_batch(img[1:2], SPEC, compute, cache, channels=1)  # caches frame 1 only
    assert (r1.hits, r1.misses) == (0, 1)
    out2, r2 = map_batch(img, SPEC, compute, cache, channels=1)
    assert calls[-1] == [0, 2] and (r2.hits, r2.misses) == (1, 2)
    assert torch.equal(out2[1], out1[0])
    out3, r3 = map_batch(img, SPEC, compute, cache, channels=1)
    assert len(calls) == 2 and (r3.hits, r3.misses) == (3, 0)
    assert torch.equal(out3, out2)
    assert r3.cache_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.pt")) > 0
    assert set(r3.ui()) == {"hits", "misses", "seconds", "cache_bytes"}


def test_map_batch_without_cache_writes_nothing(tmp_path):
    img = _image(b=2)
    out, r = map_batch(img, SPEC, lambda idx: [_u8() for _ in idx], None, channels=1)
    assert out.shape == (2, 32, 48, 3) and r.misses == 2 and r.hits == 0
    assert list(tmp_path.iterdir()) == []


def test_map_batch_rejects_wrong_sized_maps(tmp_path):
    with pytest.raises(RuntimeError, match="map for a 32x48 frame"):
        map_batch(_image(), SPEC, lambda idx: [_u8(h=10) for _ in idx], ConditionCache(str(tmp_path)), 1)


# -------------------------------------------------------------------------------------- eviction
def test_lru_eviction_by_access_time(tmp_path):
    cache = ConditionCache(str(tmp_path))
    cache.put(_key(0), _u8(seed=0))
    size = (tmp_path / f"{_key(0)}.pt").stat().st_size
    cache.max_bytes = int(3.5 * size)
    cache.put(_key(1), _u8(seed=1))
    cache.put(_key(2), _u8(seed=2))
    assert cache.get(_key(0)) is not None  # 0 is now the most recently used
    cache.put(_key(3), _u8(seed=3))  # over the cap: evicts the least recently used, 1
    left = sorted(p.name[:-3] for p in tmp_path.glob("*.pt"))
    assert left == sorted([_key(0), _key(2), _key(3)])
    assert cache.evicted == 1
    assert cache.set_max_bytes(size) == 2  # keeps only the newest
    assert [p.name for p in tmp_path.glob("*.pt")] == [f"{_key(3)}.pt"]


def test_eviction_and_clear_never_touch_foreign_files(tmp_path):
    foreign = [tmp_path / "notes.txt", tmp_path / "model.pt", tmp_path / ("AB" * 32 + ".pt"),
               tmp_path / "sub" / f"{_key(8)}.pt", tmp_path / f".{_key(7)}.tmp"]
    for f in foreign:
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"x" * 10000)
        os.utime(f, ns=(1, 1))  # very old, would go first if eviction looked at it
    cache = ConditionCache(str(tmp_path), max_bytes=0)
    assert not cache.put(_key(1), _u8())  # bigger than a 0 cap: not stored
    cache.max_bytes = 10 ** 9
    cache.put(_key(1), _u8())
    cache.set_max_bytes(0)
    assert cache.clear() == (0, 0)
    assert all(f.exists() for f in foreign)
    assert cache.stats().entries == 0


def test_stale_temp_files_of_our_own_are_cleaned(tmp_path):
    cache = ConditionCache(str(tmp_path))
    stale = tmp_path / f".{_key(1)}.abc123_x.tmp"
    fresh = tmp_path / f".{_key(2)}.def456.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    cache.stats()
    assert not stale.exists() and fresh.exists()


# ------------------------------------------------------------------------------------- bad files
def _entry(key, m=None, **over):
    m = _u8() if m is None else m
    e = {"format": cc.CACHE_FORMAT_VERSION, "key": key, "kind": "t", "map": m,
         "height": m.shape[0], "width": m.shape[1], "channels": 1 if m.ndim == 2 else m.shape[2]}
    e.update(over)
    return e


def _write(path, obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.write_bytes(buf.getvalue())


def _assert_rejected(cache, tmp_path, key, caplog, **expect):
    path = tmp_path / f"{key}.pt"
    assert path.exists()
    with caplog.at_level(logging.WARNING):
        assert cache.get(key, **expect) is None
    assert not path.exists()
    msgs = [r.getMessage() for r in caplog.records if "rejected bad entry" in r.getMessage()]
    assert len(msgs) == 1 and "\n" not in msgs[0] and str(path) in msgs[0]
    caplog.clear()


def test_corrupt_and_truncated_files_are_rejected_deleted_and_recomputed(tmp_path, caplog):
    cache = ConditionCache(str(tmp_path))
    img = _image()
    key = frame_key(img[0], SPEC)
    path = tmp_path / f"{key}.pt"
    compute = lambda idx: [_u8(seed=5) for _ in idx]  # noqa: E731
    ref, _ = map_batch(img, SPEC, compute, cache, channels=1)
    good = path.read_bytes()

    path.write_bytes(os.urandom(len(good)))
    _assert_rejected(cache, tmp_path, key, caplog)
    path.write_bytes(good[: len(good) // 2])
    _assert_rejected(cache, tmp_path, key, caplog)
    path.write_bytes(b"")
    _assert_rejected(cache, tmp_path, key, caplog)

    path.write_bytes(good[:100])
    out, r = map_batch(img, SPEC, compute, cache, channels=1)
    assert r.misses == 1 and torch.equal(out, ref) and path.read_bytes() == good
    assert cache.rejected == 4


class _Payload:
    """Unpickling this creates the marker file (stands in for arbitrary code execution)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_hostile_pickle_never_runs(tmp_path, caplog):
    cache = ConditionCache(str(tmp_path))
    marker = tmp_path.parent / (tmp_path.name + "_pwned")
    # The payload is live: a plain unpickle does run it.
    probe = tmp_path.parent / (tmp_path.name + "_probe")
    pickle.loads(pickle.dumps(_Payload(str(probe)))).close()
    assert probe.exists()

    _write(tmp_path / f"{_key(1)}.pt", _entry(_key(1), kind=_Payload(str(marker))))  # torch zip format
    (tmp_path / f"{_key(2)}.pt").write_bytes(pickle.dumps(_Payload(str(marker))))  # legacy raw pickle
    _write(tmp_path / f"{_key(3)}.pt", {**_entry(_key(3)), "extra": _Payload(str(marker))})
    for k in (1, 2, 3):
        _assert_rejected(cache, tmp_path, _key(k), caplog)
    assert not marker.exists()


@pytest.mark.parametrize("case", ["wrong_key", "wrong_format", "float_map", "shape_mismatch",
                                  "extra_field", "list_metadata", "bare_tensor", "tensor_subclass",
                                  "expect_hw", "expect_channels"])
def test_invalid_entries_are_rejected(tmp_path, caplog, case):
    cache = ConditionCache(str(tmp_path))
    key = _key(1)
    path = tmp_path / f"{key}.pt"
    expect = {}
    if case == "wrong_key":
        cache.put(_key(2), _u8())
        os.replace(tmp_path / f"{_key(2)}.pt", path)
    elif case == "wrong_format":
        _write(path, _entry(key, format=cc.CACHE_FORMAT_VERSION + 1))
    elif case == "float_map":
        _write(path, _entry(key, m=torch.rand(32, 48)))
    elif case == "shape_mismatch":
        _write(path, _entry(key, height=31))
    elif case == "extra_field":
        _write(path, {**_entry(key), "note": "x"})
    elif case == "list_metadata":
        _write(path, _entry(key, kind=["t"]))
    elif case == "bare_tensor":
        _write(path, _u8())
    elif case == "tensor_subclass":
        _write(path, _entry(key, m=torch.nn.Parameter(_u8(), requires_grad=False)))
    elif case == "expect_hw":
        cache.put(key, _u8())
        expect = {"expect_hw": (64, 64)}
    elif case == "expect_channels":
        cache.put(key, _u8())
        expect = {"expect_channels": 3}
    _assert_rejected(cache, tmp_path, key, caplog, **expect)


# ----------------------------------------------------------------------------------- concurrency
def test_concurrent_writers_and_readers_same_key(tmp_path):
    caches = [ConditionCache(str(tmp_path)) for _ in range(2)]  # as two prompts/processes would
    key = _key(7)
    m = _u8(h=256, w=256, c=3, seed=3)
    bad = []
    start = threading.Barrier(6)

    def writer(c):
        start.wait()
        for _ in range(15):
            c.put(key, m)

    def reader(c):
        start.wait()
        for _ in range(60):
            got = c.get(key, expect_hw=(256, 256), expect_channels=3)
            if got is not None and not torch.equal(got, m):
                bad.append("mismatch")

    threads = [threading.Thread(target=writer, args=(caches[i % 2],)) for i in range(3)]
    threads += [threading.Thread(target=reader, args=(caches[i % 2],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert sum(c.rejected for c in caches) == 0
    assert [p.name for p in tmp_path.iterdir()] == [f"{key}.pt"]  # no temp files left behind
    assert torch.equal(caches[0].get(key), m)


def test_concurrent_prompts_same_frame(tmp_path):
    img = _image(b=2, h=64, w=64)
    outs = []
    lock = threading.Lock()

    def prompt():
        cache = ConditionCache(str(tmp_path))
        out, _ = map_batch(img, SPEC, lambda idx: [(img[i, ..., 1] * 255).to(torch.uint8) for i in idx],
                           cache, channels=1)
        with lock:
            outs.append(out)

    threads = [threading.Thread(target=prompt) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert len(list(tmp_path.glob("*.pt"))) == 2


# ------------------------------------------------------------------------------ location / shared
def test_default_dir_and_env_override(tmp_path, monkeypatch):
    monkeypatch.delenv(cc.ENV_DIR, raising=False)
    assert cc.default_cache_dir(str(tmp_path)) == os.path.join(str(tmp_path), "sd_accel", "condition_cache")
    monkeypatch.setenv(cc.ENV_DIR, str(tmp_path / "elsewhere"))
    assert cc.default_cache_dir(str(tmp_path)) == str(tmp_path / "elsewhere")


def test_shared_cache_is_one_per_folder_and_cap_is_settable(tmp_path, monkeypatch):
    monkeypatch.setenv(cc.ENV_MAX_MB, "64")
    a = cc.shared_cache(str(tmp_path / "s"))
    assert a is cc.shared_cache(str(tmp_path / "s" / ".." / "s"))
    assert a.max_bytes == 64 * 1024 ** 2
    cc.shared_cache(str(tmp_path / "s"), max_bytes=1024)
    assert a.max_bytes == 1024
    assert cc.DEFAULT_MAX_BYTES == 2 * 1024 ** 3


def test_stats_and_clear(tmp_path):
    cache = ConditionCache(str(tmp_path / "c"))
    for i in range(3):
        cache.put(_key(i), _u8(seed=i))
    cache.get(_key(0))
    cache.get(_key(5))
    st = cache.stats()
    assert (st.entries, st.hits, st.misses, st.writes) == (3, 1, 1, 3)
    assert st.bytes == sum(p.stat().st_size for p in (tmp_path / "c").glob("*.pt"))
    text = st.as_text()
    assert str(tmp_path / "c") in text and "3 entries" in text and "1 hits, 1 misses" in text
    n, b = cache.clear()
    assert n == 3 and b == st.bytes and cache.stats().entries == 0
