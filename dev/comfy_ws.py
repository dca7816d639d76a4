"""ComfyUI's websocket (`/ws?clientId=...`) as a browser tab sees it, read by a thread (stdlib only).

Every message is kept with the `time.perf_counter()` of its arrival: JSON messages (`executing`, `progress`,
`execution_start`, ...) as dicts, binary ones (previews) as their event type (the first 4 bytes, big-endian;
ComfyUI's protocol.py: 1 PREVIEW_IMAGE, 3 TEXT, 4 PREVIEW_IMAGE_WITH_METADATA) and payload. ComfyUI sends a
prompt's messages only to the client id that queued it, so queue with the same `client_id`.

A minimal RFC 6455 client: no extensions asked for (so no compression), server frames unmasked, ours masked,
pings answered.
"""
import base64
import hashlib
import json
import os
import socket
import struct
import threading
import time
import urllib.parse

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PREVIEW_IMAGE, TEXT, PREVIEW_IMAGE_WITH_METADATA = 1, 3, 4


class Message:
    __slots__ = ("t", "type", "data", "binary")

    def __init__(self, t, type_, data, binary):
        self.t, self.type, self.data, self.binary = t, type_, data, binary

    def __repr__(self):
        what = "%d bytes" % len(self.data) if self.binary else json.dumps(self.data)[:120]
        return "<%s %s %s>" % ("binary" if self.binary else "json", self.type, what)


class Events:
    def __init__(self, url, client_id, feature_flags=None, timeout=30):
        u = urllib.parse.urlparse(url)
        self.client_id = client_id
        self.messages = []
        self.closed = False
        self._cv = threading.Condition()
        self._sock = socket.create_connection((u.hostname, u.port or 80), timeout=timeout)
        self._buf = bytearray(self._handshake(u, client_id))
        self._sock.settimeout(None)
        self._thread = threading.Thread(target=self._read_loop, name="comfy-ws", daemon=True)
        self._thread.start()
        if feature_flags is not None:   # as ComfyUI's frontend does: its first message, before any prompt
            self.send_json({"type": "feature_flags", "data": feature_flags})

    def _handshake(self, u, client_id):
        key = base64.b64encode(os.urandom(16)).decode()
        req = ("GET /ws?clientId=%s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n" % (client_id, u.netloc, key))
        self._sock.sendall(req.encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self._sock.recv(4096)
            if not chunk:
                raise ConnectionError("the server closed the websocket handshake: %r" % buf[:200])
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        if " 101 " not in lines[0] + " ":
            raise ConnectionError("no websocket upgrade: %s" % lines[0])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        want = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        if headers.get("sec-websocket-accept") != want:
            raise ConnectionError("bad Sec-WebSocket-Accept: %r" % headers.get("sec-websocket-accept"))
        return rest

    # -- frames -----------------------------------------------------------------------------------
    def _read(self, n):
        while len(self._buf) < n:
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("websocket closed")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _frame(self):
        b0, b1 = self._read(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", self._read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", self._read(8))[0]
        mask = self._read(4) if b1 & 0x80 else None
        data = self._read(n)
        if mask:
            data = bytes(c ^ mask[i % 4] for i, c in enumerate(data))
        return bool(b0 & 0x80), b0 & 0x0F, data

    def _send_frame(self, opcode, payload):
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        self._sock.sendall(head + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(payload)))

    def send_json(self, obj):
        self._send_frame(0x1, json.dumps(obj).encode())

    def _read_loop(self):
        parts, opcode = [], None
        try:
            while True:
                fin, op, data = self._frame()
                if op == 0x8:
                    break
                if op == 0x9:
                    self._send_frame(0xA, data)
                    continue
                if op in (0x1, 0x2):
                    parts, opcode = [data], op
                elif op == 0x0:
                    parts.append(data)
                else:
                    continue
                if fin:
                    self._keep(time.perf_counter(), opcode, b"".join(parts))
        except (ConnectionError, OSError):
            pass
        finally:
            with self._cv:
                self.closed = True
                self._cv.notify_all()

    def _keep(self, t, opcode, payload):
        if opcode == 0x1:
            msg = json.loads(payload)
            m = Message(t, msg.get("type"), msg.get("data"), False)
        else:
            m = Message(t, struct.unpack(">I", payload[:4])[0], payload[4:], True)
        with self._cv:
            self.messages.append(m)
            self._cv.notify_all()

    # -- reading ----------------------------------------------------------------------------------
    def wait_for(self, pred, start=0, timeout=600):
        """Index of the first message at or after `start` for which `pred(message)` holds."""
        t_end = time.time() + timeout
        i = start
        with self._cv:
            while True:
                while i < len(self.messages):
                    if pred(self.messages[i]):
                        return i
                    i += 1
                left = t_end - time.time()
                if self.closed or left <= 0:
                    raise TimeoutError("no such websocket message in %ss (closed: %s); last: %r"
                                       % (timeout, self.closed, self.messages[-5:]))
                self._cv.wait(min(left, 1.0))

    def wait_done(self, prompt_id, start=0, timeout=600):
        """Index of the `executing` message with node None that ends `prompt_id` (both ComfyUIs send it
        after the prompt's history is written, success or not)."""
        return self.wait_for(lambda m: not m.binary and m.type == "executing" and m.data.get("node") is None
                             and m.data.get("prompt_id") == prompt_id, start, timeout)

    def of_prompt(self, prompt_id, start=0):
        """The messages of one prompt: from its `execution_start` to the `executing` None that ends it; binary
        ones carry no prompt id and are taken by position (ComfyUI sends one prompt's messages at a time)."""
        with self._cv:
            msgs = self.messages[start:]
        out, inside = [], False
        for m in msgs:
            pid = None if m.binary else (m.data or {}).get("prompt_id")
            if not inside and m.type == "execution_start" and pid == prompt_id:
                inside = True
            if inside:
                out.append(m)
                if m.type == "executing" and pid == prompt_id and m.data.get("node") is None:
                    break
        return out

    def mark(self):
        with self._cv:
            return len(self.messages)

    def close(self):
        try:
            self._send_frame(0x8, b"")
        except OSError:
            pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
