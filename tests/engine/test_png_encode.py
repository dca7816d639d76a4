"""The striped PNG encoder (engine/png_encode.py): files any decoder reads back to the same pixels, one valid zlib
stream over the stripes, valid chunk CRCs, the text chunks PIL's PngInfo.add_text writes, SaveImage's conversion."""
import concurrent.futures
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from sd_accel.engine import png_encode

TEXT = {"prompt": '{"3": {"class_type": "KSampler"}}', "workflow": '{"nodes": []}'}


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(4) as p:
        yield p


def _chunks(data):
    assert data[:8] == png_encode.SIGNATURE
    pos, out = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        crc, = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body), kind
        out.append((kind, body))
        pos += 12 + n
    return out


def _photo(h, w, c, seed=0):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = (np.sin(x / 7.0) + np.cos(y / 11.0)) * 60 + 128
    img = base[..., None] + rng.normal(0, 6, (h, w, c))
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("shape", [(1, 1, 3), (3, 5, 3), (64, 97, 3), (96, 64, 4), (257, 130, 3)],
                         ids=["1x1", "3x5", "odd_width", "rgba", "many_rows"])
@pytest.mark.parametrize("level", [0, 1])
def test_pixels_read_back_equal_through_one_zlib_stream_over_many_stripes(shape, level, pool, monkeypatch):
    monkeypatch.setattr(png_encode, "MIN_STRIPE_BYTES", 512)   # small images cut into several stripes too
    pixels = _photo(*shape)
    data = png_encode.encode(pixels, level, TEXT, pool, threads=4)
    back = Image.open(io.BytesIO(data))
    assert back.mode == ("RGB" if shape[2] == 3 else "RGBA")
    assert np.array_equal(np.asarray(back), pixels)
    chunks = _chunks(data)
    idat = [body for kind, body in chunks if kind == b"IDAT"]
    nbytes = shape[0] * (shape[1] * shape[2] + 1)
    assert len(idat) == max(1, min(4, nbytes // 512, shape[0]))   # one IDAT per stripe: 4 for all but the tiny
    raw = zlib.decompress(b"".join(idat))   # one stream: header, stripes, Adler-32 all checked by zlib
    assert len(raw) == shape[0] * (shape[1] * shape[2] + 1)
    assert [k for k, _ in chunks] == [b"IHDR", b"tEXt", b"tEXt"] + [b"IDAT"] * len(idat) + [b"IEND"]


def test_the_zlib_header_names_the_level_class_zlib_writes(pool):
    pixels = _photo(8, 8, 3)
    for level in (0, 1):
        idat = b"".join(b for k, b in _chunks(png_encode.encode(pixels, level, None, pool, 2)) if k == b"IDAT")
        assert idat[:2] == zlib.compress(b"x", level)[:2]


def test_text_chunks_are_the_ones_pil_writes_latin1_and_not(pool):
    text = {"prompt": TEXT["prompt"], "workflow": "caf\u00e9", "note": "\u732b \u2014 cat"}
    ours = [c for c in _chunks(png_encode.encode(_photo(4, 4, 3), 1, text, pool, 2)) if c[0] in (b"tEXt", b"iTXt")]
    info = PngInfo()
    for k, v in text.items():
        info.add_text(k, v)
    buf = io.BytesIO()
    Image.fromarray(_photo(4, 4, 3)).save(buf, format="PNG", pnginfo=info)
    pils = [c for c in _chunks(buf.getvalue()) if c[0] in (b"tEXt", b"iTXt")]
    assert ours == pils and [k for k, _ in ours] == [b"tEXt", b"tEXt", b"iTXt"]
    assert Image.open(io.BytesIO(png_encode.encode(_photo(4, 4, 3), 1, text, pool, 2))).text == text


def test_the_conversion_is_saveimage_s_for_every_value(pool):
    x = torch.tensor([[-0.5, 0.0, 0.001, 0.5, 0.99999, 1.0, 1.7, float("nan")]] * 9).reshape(9, 8, 1)
    x = x.expand(9, 8, 3).contiguous()
    stock = np.clip(255. * x.cpu().numpy(), 0, 255).astype(np.uint8)
    assert np.array_equal(png_encode.to_uint8(x, pool, 4), stock)


def test_only_rgb_and_rgba_images_are_taken():
    assert png_encode.can_encode((512, 512, 3)) and png_encode.can_encode((8, 8, 4))
    assert not png_encode.can_encode((8, 8, 1)) and not png_encode.can_encode((8, 8)) \
        and not png_encode.can_encode((0, 8, 3))
