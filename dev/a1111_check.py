#!/usr/bin/env python3
"""End-to-end check of the SD Accel extension in a real AUTOMATIC1111 WebUI (stdlib only).

Drives A1111's HTTP API and the extension's read-only `GET /sd_accel/status`:
  1. the `sd_accel_*` settings are listed by `GET /sdapi/v1/options`;
  2. enabled (the default): modules patched; txt2img -> image A;
  3. `POST /sdapi/v1/options {"sd_accel_enabled": false}`: every module restored; txt2img -> image B;
     PSNR(A, B) >= 35 dB (on CPU the kernels fall back to torch, or run in Triton's interpreter);
  4. on again; switch to a second checkpoint of the same config (A1111 reloads it into the SAME
     model object with load_state_dict(strict=False)): state_dict keys unchanged, patched; image C;
  5. off, switch away and back (a stock reload of the same weights): image D; PSNR(C, D) >= 35 dB,
     so the patched reload skipped no weight.

Either point it at a running A1111 (`--url`), or let it start one (`--webui DIR --python PY`) with the
CPU recipe of shared/research/a1111_feasibility.md (headless, `--nowebui`, 127.0.0.1 only); the
extension must be in `<webui>/extensions/`. Exit status 0 when every check passes.

  python dev/a1111_check.py --webui vendor/a1111 --python ~/.cache/sd_accel/a1111-venv/bin/python \
      --ckpt ci_small_s0.safetensors --ckpt2 ci_small_s1.safetensors --hf-home ~/.cache/sd_accel/a1111/hf
"""
import argparse
import base64
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib

PSNR_MIN = 35.0


# -- HTTP -----------------------------------------------------------------------------------------

def call(url, path, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode() or "null")


def wait_ready(url, proc, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise SystemExit("the WebUI exited with %s before it was ready" % proc.returncode)
        try:
            call(url, "/sdapi/v1/sd-models", timeout=5)
            return time.time() - t0
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(1.0)
    raise SystemExit("the WebUI was not ready after %d s" % timeout)


# -- PNG (stdlib) ---------------------------------------------------------------------------------

def decode_png(blob):
    """(width, height, channels, bytes) of an 8-bit RGB/RGBA/grey PNG, non-interlaced."""
    assert blob[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(blob):
        n, kind = struct.unpack(">I4s", blob[pos:pos + 8])
        chunk = blob[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat.append(chunk)
        elif kind == b"IEND":
            break
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and interlace == 0, "only 8-bit non-interlaced PNGs"
    ch = {0: 1, 2: 3, 4: 2, 6: 4}[ctype]
    raw = zlib.decompress(b"".join(idat))
    stride = w * ch
    out = bytearray(h * stride)
    prev = bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - ch] if i >= ch else 0
            b = prev[i]
            c = prev[i - ch] if i >= ch else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out[y * stride:(y + 1) * stride] = line
        prev = line
    return w, h, ch, bytes(out)


def encode_png(width, height, rgb):
    """An 8-bit RGB PNG of `rgb` (bytes, rows top to bottom), stdlib only: an input image for the API."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    rows = b"".join(b"\x00" + rgb[y * width * 3:(y + 1) * width * 3] for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def psnr(png_a, png_b):
    wa, ha, ca, a = decode_png(png_a)
    wb, hb, cb, b = decode_png(png_b)
    assert (wa, ha, ca) == (wb, hb, cb), "image sizes differ"
    mse = sum((x - y) ** 2 for x, y in zip(a, b)) / len(a)
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


# -- the checks -----------------------------------------------------------------------------------

class Checker:
    def __init__(self, url, args):
        self.url, self.args = url, args
        self.failures = []
        self.n_checks = 0

    def check(self, ok, what):
        self.n_checks += 1
        print("[check] %s %s" % ("PASS" if ok else "FAIL", what), flush=True)
        if not ok:
            self.failures.append(what)

    def status(self):
        return call(self.url, "/sd_accel/status")

    def set(self, **opts):
        t0 = time.time()
        call(self.url, "/sdapi/v1/options", opts)
        return time.time() - t0

    def txt2img(self, tag):
        body = {"prompt": "a photo of a cat", "negative_prompt": "", "seed": 1234, "steps": self.args.steps,
                "width": 64, "height": 64, "cfg_scale": 7, "sampler_name": "Euler", "batch_size": 1,
                "send_images": True, "save_images": False}
        t0 = time.time()
        r = call(self.url, "/sdapi/v1/txt2img", body)
        png = base64.b64decode(r["images"][0].split(",", 1)[-1])
        print("[txt2img] %s: %.1f s, %d-byte PNG" % (tag, time.time() - t0, len(png)), flush=True)
        return png

    def checkpoint_title(self, filename):
        for m in call(self.url, "/sdapi/v1/sd-models"):
            if os.path.basename(m["filename"]) == filename:
                return m["title"]
        raise SystemExit("checkpoint %s not listed by /sdapi/v1/sd-models" % filename)

    def run(self):
        keys = ["sd_accel_enabled", "sd_accel_fused_kernels", "sd_accel_cuda_graph", "sd_accel_channels_last"]
        opts = call(self.url, "/sdapi/v1/options")
        self.check(all(k in opts for k in keys), "GET /sdapi/v1/options lists %s: %s"
                   % (keys, {k: opts.get(k, "MISSING") for k in keys}))
        if not opts.get("sd_accel_enabled", True):
            self.set(sd_accel_enabled=True)
        t0 = time.time()
        while self.status()["model"] is None:   # A1111 loads the checkpoint in the background
            if time.time() - t0 > self.args.ready_timeout:
                raise SystemExit("no model loaded after %d s" % self.args.ready_timeout)
            time.sleep(1.0)
        print("[launch] model loaded %.1f s after the API was up" % (time.time() - t0), flush=True)
        s = self.status()
        print("[status] %s" % json.dumps({k: s.get(k) for k in ("patched", "counts", "channels_last",
                                          "state_dict_keys_unchanged", "unet_option", "graphs")}), flush=True)
        self.check(s["patched"] > 0 and s["state_dict_keys_unchanged"], "enabled: %d modules patched" % s["patched"])
        self.check(sum(s["counts"].values()) == s["patched"], "the per-op counts %s add up to the %d patched"
                   % (s["counts"], s["patched"]))
        self.check(s.get("settings") == {"section": "SD Accel", "category": "Stable Diffusion"},
                   "settings filed under %s (the category of A1111's Optimizations section)" % s.get("settings"))
        k0 = self.status().get("kernels", {})
        img_on = self.txt2img("SD Accel on")
        s = self.status()
        print("[status] after txt2img: graphs %s" % s.get("graphs"), flush=True)
        ran = {op: {"fused": e["fused"] - k0.get(op, {}).get("fused", 0),
                    "fallback": e["fallback"] - k0.get(op, {}).get("fallback", 0), "reasons": e["reasons"]}
               for op, e in s.get("kernels", {}).items()}
        print("[status] kernel calls in that txt2img: %s" % json.dumps(ran), flush=True)
        if self.args.expect_fused:
            ops = ("geglu", "group_norm", "group_norm_silu", "layer_norm")
            self.check(all(ran.get(op, {}).get("fused", 0) > 0 for op in ops),
                       "the fused Triton kernels ran inside A1111: %s" % ", ".join(
                           "%s x%d" % (op, ran.get(op, {}).get("fused", 0)) for op in ops))
            for op, e in sorted(ran.items()):
                if e["fallback"]:
                    print("[note] %s: %d of %d calls took the stock path (%s)" % (
                        op, e["fallback"], e["fallback"] + e["fused"], "; ".join(e["reasons"])), flush=True)

        dt = self.set(sd_accel_enabled=False)
        s = self.status()
        self.check(s["patched"] == 0 and not s["paths"],
                   "toggle off (%.2f s): modules restored (%d patched)" % (dt, s["patched"]))
        self.check(call(self.url, "/sdapi/v1/options")["sd_accel_enabled"] is False, "GET shows sd_accel_enabled false")
        img_off = self.txt2img("SD Accel off")
        p = psnr(img_on, img_off)
        self.check(p >= PSNR_MIN, "on vs off: PSNR %.2f dB (>= %.0f)" % (p, PSNR_MIN))

        dt = self.set(sd_accel_enabled=True)
        s = self.status()
        self.check(s["patched"] > 0, "toggle on again (%.2f s): %d modules patched" % (dt, s["patched"]))
        if not self.args.ckpt2:
            return
        t1, t2 = self.checkpoint_title(self.args.ckpt), self.checkpoint_title(self.args.ckpt2)
        dt = self.set(sd_model_checkpoint=t2)
        s = self.status()
        self.check(s["patched"] > 0 and s["state_dict_keys_unchanged"],
                   "checkpoint switch to %s (%.1f s, same object, strict=False): %d patched, keys unchanged %s"
                   % (t2, dt, s["patched"], s["state_dict_keys_unchanged"]))
        img_c = self.txt2img("second checkpoint, SD Accel on")
        p0 = psnr(img_on, img_c)
        self.check(p0 < PSNR_MIN, "the second checkpoint's weights changed the image (PSNR %.2f dB vs the first)" % p0)
        self.set(sd_accel_enabled=False)
        self.set(sd_model_checkpoint=t1)
        self.set(sd_model_checkpoint=t2)
        s = self.status()
        self.check(s["patched"] == 0, "stock reload of the second checkpoint (%d patched)" % s["patched"])
        img_d = self.txt2img("second checkpoint, stock reload, SD Accel off")
        p = psnr(img_c, img_d)
        self.check(p >= PSNR_MIN, "patched reload vs stock reload: PSNR %.2f dB (>= %.0f): no skipped weights"
                   % (p, PSNR_MIN))
        self.set(sd_accel_enabled=True, sd_model_checkpoint=t1)


def launch(args):
    webui = os.path.abspath(args.webui)
    cmd = [args.python, "launch.py", "--skip-prepare-environment", "--skip-install", "--skip-torch-cuda-test",
           "--skip-version-check", "--use-cpu", "all", "--no-half", "--precision", "full",
           "--no-download-sd-model", "--do-not-download-clip", "--server-name", "127.0.0.1",
           "--port", str(args.port), "--api", "--nowebui", "--ckpt",
           os.path.join("models", "Stable-diffusion", args.ckpt)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    if args.hf_home:
        env["HF_HOME"] = os.path.abspath(os.path.expanduser(args.hf_home))
    for kv in args.env:
        k, _, v = kv.partition("=")
        env[k] = v
    log = open(args.log, "w")
    print("[launch] %s (log: %s)" % (" ".join(cmd), args.log), flush=True)
    return subprocess.Popen(cmd, cwd=webui, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running A1111 (default: start one from --webui)")
    ap.add_argument("--webui")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--port", type=int, default=7861)
    ap.add_argument("--ckpt", required=True, help="file name under models/Stable-diffusion/")
    ap.add_argument("--ckpt2", help="a second checkpoint of the same config, for the switch check")
    ap.add_argument("--hf-home")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the A1111 process")
    ap.add_argument("--log", default="a1111_check.log")
    ap.add_argument("--expect-fused", action="store_true",
                    help="require the Triton kernels to run (GPU, or CPU with --env TRITON_INTERPRET=1)")
    ap.add_argument("--ready-timeout", type=int, default=300)
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        if not args.webui:
            ap.error("--url or --webui is needed")
        proc = launch(args)
        url = "http://127.0.0.1:%d" % args.port
    try:
        dt = wait_ready(url, proc, args.ready_timeout)
        print("[launch] ready after %.1f s" % dt, flush=True)
        c = Checker(url, args)
        c.run()
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    if proc is not None:
        with open(args.log, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if "SD Accel" in ln]
        print("[a1111 log] %d SD Accel lines:" % len(lines))
        for ln in lines:
            print("  " + ln)
    print("%d passed, %d failed" % (c.n_checks - len(c.failures), len(c.failures)))
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
