"""One 8-bit RGB or RGBA image as PNG bytes, its compression spread over threads: for Save Image (SD Accel) at the
fast levels (0 and 1), where one image's zlib stream is most of its saving time and a batch of one has no other
image to encode beside it.

The PNG format allows it as written (PNG spec, ISO/IEC 15948; zlib RFC 1950, deflate RFC 1951): the rows are
filtered (filter type 2, "Up": each byte minus the byte above it, which costs one array subtraction; at level 1
the file is about as large as an adaptively filtered one), cut into stripes of whole rows, and each stripe is
deflated on its own thread with the previous stripe's last 32 KiB as its preset dictionary; every stripe but the
last ends with a sync flush (an empty stored block, byte aligned), so the stripes' outputs joined are one valid
deflate stream, which a decoder reads as any other. One IDAT chunk per stripe, the zlib header and the Adler-32
of the whole filtered data around them. zlib releases the GIL while it compresses, as numpy does for the
conversion, so the threads run at once.
"""
import struct
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOR_TYPES = {3: 2, 4: 6}        # channels -> PNG colour type (truecolour, truecolour with alpha)
MIN_STRIPE_BYTES = 128 * 1024     # below this a stripe's thread costs more than it saves
WINDOW = 32 * 1024                # deflate's window: the preset dictionary of the next stripe
FILTER_UP = 2


def can_encode(shape):
    """Whether `encode` writes an image of this [H, W, C] shape (others: PIL's encoder)."""
    return len(shape) == 3 and shape[2] in COLOR_TYPES and shape[0] > 0 and shape[1] > 0


def to_uint8(image, pool=None, stripes=1):
    """One image of ComfyUI's IMAGE ([H, W, C] floats in 0..1, a CPU tensor or array) as SaveImage converts it
    (x 255, clipped, truncated to uint8); with a `pool`, stripes of rows converted on its threads (the same value
    for every element)."""
    x = image.cpu().numpy() if hasattr(image, "cpu") else np.asarray(image)
    if pool is None:
        return np.clip(255. * x, 0, 255).astype(np.uint8)
    out = np.empty(x.shape, np.uint8)

    def convert(rows):
        out[rows] = np.clip(255. * x[rows], 0, 255).astype(np.uint8)
    list(pool.map(convert, _row_slices(x.shape[0], stripes)))
    return out


def encode(pixels, level, text, pool, threads):
    """PNG bytes of `pixels` ([H, W, C] uint8, C 3 or 4) at zlib `level`, with `text` ({keyword: value}) as tEXt
    chunks (iTXt where a value is not Latin-1), before the image data, as PIL's PngInfo.add_text writes them."""
    h, w, c = pixels.shape
    row = w * c
    filtered = np.empty((h, row + 1), np.uint8)
    flat = pixels.reshape(h, row)
    filtered[:, 0] = FILTER_UP
    filtered[0, 1:] = flat[0]
    np.subtract(flat[1:], flat[:-1], out=filtered[1:, 1:])   # uint8 arithmetic wraps modulo 256, as PNG's does
    data = memoryview(filtered.reshape(-1))
    stripes = max(1, min(threads, len(data) // MIN_STRIPE_BYTES))
    bounds = [(s.start * (row + 1), s.stop * (row + 1)) for s in _row_slices(h, stripes)]

    def deflate(i):
        start, stop = bounds[i]
        last = i == len(bounds) - 1
        zdict = [bytes(data[max(0, start - WINDOW):start])] if start else []
        co = zlib.compressobj(level, zlib.DEFLATED, -15, 9, zlib.Z_DEFAULT_STRATEGY, *zdict)
        body = co.compress(data[start:stop]) + co.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)
        if i == 0:
            body = _zlib_header(level) + body
        if last:
            body += struct.pack(">I", zlib.adler32(data))
        return _chunk(b"IDAT", body)
    idat = list(pool.map(deflate, range(len(bounds))))
    head = _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, COLOR_TYPES[c], 0, 0, 0))
    return b"".join([SIGNATURE, head] + [_text_chunk(k, v) for k, v in (text or {}).items()] + idat
                    + [_chunk(b"IEND", b"")])


def _row_slices(rows, parts):
    parts = max(1, min(parts, rows))
    edges = [rows * i // parts for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _zlib_header(level):
    # CMF: deflate with a 32 KiB window; FLG: the level class zlib itself writes for `level`, then the check bits
    flevel = 0 if level < 2 else 1 if level < 6 else 2 if level == 6 else 3
    cmf, flg = 0x78, flevel << 6
    return bytes([cmf, flg + (31 - (cmf * 256 + flg) % 31) % 31])


def _text_chunk(key, value):
    try:
        return _chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1"))
    except UnicodeError:   # iTXt: uncompressed, no language tag, no translated keyword
        return _chunk(b"iTXt", key.encode("latin-1") + b"\0\0\0\0\0" + value.encode("utf-8"))


def _chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(body, zlib.crc32(kind)))
