"""Start, drive and stop a real ComfyUI server with this pack in its custom_nodes (stdlib only).

Used by the tests (tests/server/conftest.py) and by the demo (dev/demo.py). The pack is linked into
`<ComfyUI>/custom_nodes/<PACK_DIR_NAME>`, the name users clone it as, so the frontend serves our JS under
`/extensions/<PACK_DIR_NAME>/`. Models come from a folder given through `--extra-model-paths-config`;
inputs and outputs go to folders of the run, so the ComfyUI checkout itself stays clean apart from
that one link. Other custom-node packs (`extra_nodes`: the tests' stand-ins for other packs) are linked into a
custom_nodes folder of the run, which ComfyUI is told of through the same config file, so two servers on one
ComfyUI checkout can load different packs.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK_DIR_NAME = "ComfyUI-SD-Accel"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def link_pack(comfy_dir, repo=REPO):
    """Symlink the repo into custom_nodes; replaces only a symlink of ours, never a real folder. A repo
    cloned there under that name (the README's install) is already in place."""
    dst = os.path.join(comfy_dir, "custom_nodes", PACK_DIR_NAME)
    if os.path.isdir(dst) and not os.path.islink(dst) and os.path.samefile(dst, repo):
        return dst
    if os.path.islink(dst):
        if os.path.realpath(dst) == os.path.realpath(repo):
            return dst
        os.unlink(dst)
    elif os.path.exists(dst):
        raise RuntimeError("%s exists and is not a symlink; remove it or use another ComfyUI" % dst)
    os.symlink(os.path.realpath(repo), dst)
    return dst


class ComfyServer:
    def __init__(self, comfy_dir, python, work_dir, models_dir, extra_args=(), env=None, port=None, cpu=True,
                 extra_nodes=()):
        self.comfy_dir = os.path.abspath(comfy_dir)
        self.extra_nodes = [os.path.abspath(p) for p in extra_nodes]
        self.python = python
        self.work_dir = os.path.abspath(work_dir)
        self.models_dir = os.path.abspath(models_dir)
        self.extra_args = list(extra_args)
        self.cpu = cpu
        self.env = dict(env or {})
        self.port = port or free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.proc = None
        self.output_dir = os.path.join(self.work_dir, "output")
        self.input_dir = os.path.join(self.work_dir, "input")
        self.log_path = os.path.join(self.work_dir, "server.log")
        self.client_id = uuid.uuid4().hex

    # -- life cycle ---------------------------------------------------------------------------
    def start(self, timeout=240):
        for d in (self.output_dir, self.input_dir, os.path.join(self.work_dir, "temp")):
            os.makedirs(d, exist_ok=True)
        link_pack(self.comfy_dir)
        cfg = os.path.join(self.work_dir, "extra_model_paths.yaml")
        with open(cfg, "w") as f:
            # UNETLoader's folders (diffusion_models, 2024's unet) -> checkpoints too: current ComfyUI's UNETLoader
            # loads a checkpoint's UNet (with weight_dtype fp8_e4m3fn, say), so the fixture checkpoints serve it
            unet_folders = "|\n        checkpoints\n        diffusion_models\n"
            f.write("sd_accel_test:\n    base_path: %s\n    checkpoints: checkpoints\n    controlnet: controlnet\n"
                    "    loras: loras\n    vae: vae\n    vae_approx: vae_approx\n    hypernetworks: hypernetworks\n"
                    "    diffusion_models: %s    unet: %s" % (self.models_dir, unet_folders, unet_folders))
            if self.extra_nodes:
                f.write("sd_accel_test_nodes:\n    base_path: %s\n    custom_nodes: custom_nodes\n"
                        % self._link_extra_nodes())
        cmd = [self.python, "main.py"] + (["--cpu"] if self.cpu else []) + ["--listen", "127.0.0.1", "--port", str(self.port),
               "--disable-auto-launch", "--output-directory", self.output_dir, "--input-directory",
               self.input_dir, "--temp-directory", os.path.join(self.work_dir, "temp"),
               "--extra-model-paths-config", cfg] + self.extra_args
        env = dict(os.environ)
        if self.cpu:
            env.setdefault("OMP_NUM_THREADS", "1")   # 2 threads on 2 busy cores run 5-10x slower
        env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        env.update(self.env)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        t_end = time.time() + timeout
        while time.time() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError("ComfyUI exited with %s:\n%s" % (self.proc.returncode, self.log_tail()))
            try:
                self.get("/object_info/KSampler", timeout=5)
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("ComfyUI did not answer within %ss:\n%s" % (timeout, self.log_tail()))

    def _link_extra_nodes(self):
        """Symlinks each of `extra_nodes` into <work_dir>/custom_nodes under its own folder name (the module
        name ComfyUI imports it as); returns <work_dir>."""
        folder = os.path.join(self.work_dir, "custom_nodes")
        os.makedirs(folder, exist_ok=True)
        names = [os.path.basename(p) for p in self.extra_nodes]
        if len(set(names)) != len(names):
            raise ValueError("extra_nodes need distinct folder names: %s" % names)
        for src, name in zip(self.extra_nodes, names):
            dst = os.path.join(folder, name)
            if os.path.islink(dst):
                os.unlink(dst)
            os.symlink(src, dst)
        return self.work_dir

    def stop(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def log_text(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, n=60):
        return "\n".join(self.log_text().splitlines()[-n:])

    # -- HTTP ---------------------------------------------------------------------------------
    def get(self, path, timeout=30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            body = r.read()
            ctype = r.headers.get("Content-Type", "")
        return json.loads(body) if "json" in ctype else body

    def post(self, path, data, timeout=30):
        req = urllib.request.Request(self.url + path, data=json.dumps(data).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:   # ComfyUI answers 400 with a JSON body on a bad prompt
            raise PromptRejected(e.code, e.read().decode("utf-8", "replace")) from None

    def object_info(self):
        return self.get("/object_info")

    def queue(self, prompt, client_id=None, extra_data=None):
        """POST /prompt; `extra_data` as the frontend sends it (e.g. {"extra_pnginfo": {"workflow": ...}})."""
        body = {"prompt": prompt, "client_id": client_id or self.client_id}
        if extra_data is not None:
            body["extra_data"] = extra_data
        return self.post("/prompt", body)["prompt_id"]

    def events(self, client_id=None, feature_flags=None):
        """The websocket of `client_id` (default: the one `queue` uses), read by a thread (dev/comfy_ws.py).
        `feature_flags`: sent first, as the frontend does (current ComfyUI then sends previews with metadata)."""
        import comfy_ws
        return comfy_ws.Events(self.url, client_id or self.client_id, feature_flags)

    def wait(self, prompt_id, timeout=600):
        t_end = time.time() + timeout
        while time.time() < t_end:
            hist = self.get("/history/%s" % prompt_id)
            if prompt_id in hist:
                entry = hist[prompt_id]
                status = entry.get("status", {})
                if status.get("completed") or status.get("status_str") in ("success", "error"):
                    return entry
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError("ComfyUI died while running a prompt:\n%s" % self.log_tail())
            time.sleep(0.2)
        raise TimeoutError("prompt %s did not finish in %ss:\n%s" % (prompt_id, timeout, self.log_tail()))

    def run(self, prompt, timeout=600, expect_success=True, extra_data=None):
        entry = self.wait(self.queue(prompt, extra_data=extra_data), timeout)
        ok = entry.get("status", {}).get("status_str") == "success"
        if expect_success and not ok:
            raise RuntimeError("prompt failed: %s\n%s" % (json.dumps(entry.get("status"))[:4000], self.log_tail()))
        return entry

    def output_images(self, entry):
        """Absolute paths of the images a finished prompt saved, in node order."""
        paths = []
        for node_id in sorted(entry.get("outputs", {}), key=str):
            for img in entry["outputs"][node_id].get("images", []):
                if img.get("type") == "output":
                    paths.append(os.path.join(self.output_dir, img.get("subfolder", ""), img["filename"]))
        return paths


class PromptRejected(Exception):
    def __init__(self, code, body):
        super().__init__("HTTP %s: %s" % (code, body[:2000]))
        self.code = code
        self.body = body


def empty_frontend(work_dir):
    """["--front-end-root", <a folder with an empty page>]: current ComfyUI serves its frontend from a package the
    GPU machine does not have; the API needs no page."""
    frontend = os.path.join(work_dir, "frontend")
    os.makedirs(frontend, exist_ok=True)
    with open(os.path.join(frontend, "index.html"), "w") as f:
        f.write("<html></html>")
    return ["--front-end-root", frontend]


def without_node_class(wf, class_type):
    """`wf` (an API prompt, changed in place) without its `class_type` nodes, each consumer of one's first output
    wired to what fed its first input (a pass-through node: Apply SD Accel (CLIP) for a stock graph)."""
    for node_id in [k for k, n in wf.items() if n["class_type"] == class_type]:
        node = wf.pop(node_id)
        source = next(v for v in node["inputs"].values() if isinstance(v, list))
        for other in wf.values():
            for name, v in other["inputs"].items():
                if v == [node_id, 0]:
                    other["inputs"][name] = list(source)
    return wf


def load_api_workflow(path, **overrides):
    """An API-format workflow from workflows/, with `{node_id: {input: value}}` overrides."""
    with open(path) as f:
        wf = json.load(f)
    for node_id, inputs in overrides.items():
        wf[str(node_id)]["inputs"].update(inputs)
    return wf


if __name__ == "__main__":
    sys.exit("import this module; see dev/demo.py")
