"""The checks dev/forge_check.py runs against a Forge it started: HTTP only (stdlib), through Forge's API
and the extension's `GET /sd_accel/status`."""
import base64
import json
import os
import random
import time
import urllib.error

from a1111_check import PSNR_MIN, call, encode_png, psnr

HR_STEPS = 2   # the hires-fix pass's steps
KEYS = ["sd_accel_enabled", "sd_accel_fused_kernels", "sd_accel_cuda_graph", "sd_accel_channels_last", "sd_accel_precision"]
OPS = ("group_norm_silu", "group_norm", "layer_norm", "geglu")
# A fused block runs some of the modules patched inside it as one op with its neighbours: the ResBlock its
# out_layers' GroupNorm+SiLU with the timestep add (resblock_add_norm), the transformer block its norm2 and norm3
# with the residual adds (transformer_add_norm). Each patched module still runs once per step, under one name.
CARRIED_BY = {"group_norm_silu": ("resblock_add_norm",), "layer_norm": ("transformer_add_norm",)}
BLOCK_OPS = {"resblock": ("resblock_bias_residual", 1), "transformer_block": ("transformer_add_norm", 2)}
# Forge's built-in FreeU: enabled, b1, b2, s1, s2, start and end (fractions of the steps, as its callback counts them)
FREEU_SCRIPT = "FreeU Integrated (SD 1.x, SD 2.x, SDXL)"
FREEU_ARGS = (True, 1.5, 1.6, 0.9, 0.2, 0.0, 0.5)


def module_calls(ran):
    """Per op of OPS: the calls of its patched modules, those run inside a fused block's op included."""
    calls = lambda op: ran.get(op, {}).get("calls", 0)  # noqa: E731
    return {op: calls(op) + sum(calls(c) for c in CARRIED_BY.get(op, ())) for op in OPS}


def block_calls(ran, counts, steps):
    """{block: (calls of its op, what one call per block and step gives)} for the fused blocks patched."""
    return {b: (ran.get(op, {}).get("calls", 0), per * steps * counts[b]) for b, (op, per) in BLOCK_OPS.items()
            if counts.get(b)}


class Checker:
    def __init__(self, url, args, ckpt, ckpt2, lora, controlnet):
        self.url, self.args, self.ckpt, self.ckpt2, self.lora = url, args, ckpt, ckpt2, lora
        self.controlnet = controlnet
        self.failures, self.n_checks = [], 0

    def check(self, ok, what):
        self.n_checks += 1
        print("[check] %s %s" % ("PASS" if ok else "FAIL", what), flush=True)
        if not ok:
            self.failures.append(what)

    def status(self):
        return call(self.url, "/sd_accel/status")

    def wait_status(self, timeout=60):
        """The status route, once the WebUI's app-started callbacks (which add it) have run."""
        t0 = time.time()
        while True:
            try:
                return self.status()
            except urllib.error.HTTPError:
                if time.time() - t0 > timeout:
                    raise
                time.sleep(1.0)

    def set(self, **opts):
        call(self.url, "/sdapi/v1/options", opts)

    def txt2img(self, tag, lora=False, hires=False, control=None, tiles=None, late_wrapper=False, freeu=None):
        body = {"prompt": "a photo of a cat" + (" <lora:%s:1>" % self.lora if lora else ""), "negative_prompt": "",
                "seed": 1234, "steps": self.args.steps, "width": 64, "height": 64, "cfg_scale": 7,
                "sampler_name": "Euler", "batch_size": 1, "send_images": True, "save_images": False}
        if control is not None:
            body["alwayson_scripts"] = {"ControlNet": {"args": [control]}}
        if tiles is not None:
            body["alwayson_scripts"] = {"MultiDiffusion Integrated": {"args": [True, "MultiDiffusion"] + list(tiles)}}
        if late_wrapper:
            body["alwayson_scripts"] = {"SD Accel check: late wrapper": {"args": [True]}}
        if freeu is not None:
            body["alwayson_scripts"] = {FREEU_SCRIPT: {"args": list(freeu)}}
        if hires:
            # Forge's API needs hr_additional_modules (its default None fails the request, with or without SD Accel)
            body.update(enable_hr=True, hr_scale=2, hr_upscaler="Latent", hr_second_pass_steps=HR_STEPS,
                        denoising_strength=0.5, hr_additional_modules=["Use same choices"])
        k0, t0 = self.status()["kernels"], time.time()
        r = call(self.url, "/sdapi/v1/txt2img", body)
        png = base64.b64decode(r["images"][0].split(",", 1)[-1])
        ran = {op: {"calls": e["fused"] + e["fallback"] - k0.get(op, {}).get("fused", 0)
                    - k0.get(op, {}).get("fallback", 0), "fused": e["fused"] - k0.get(op, {}).get("fused", 0)}
               for op, e in self.status()["kernels"].items()}
        print("[txt2img] %s: %.1f s, %d-byte PNG, kernel calls %s" % (tag, time.time() - t0, len(png), json.dumps(
            {op: e["calls"] for op, e in ran.items() if e["calls"]})), flush=True)
        return png, ran

    def same(self, a, b, what):
        p = psnr(a, b)
        self.check(p >= PSNR_MIN, "%s: PSNR %s dB (>= %.0f)" % (what, "inf (identical)" if p == float("inf")
                                                                 else "%.2f" % p, PSNR_MIN))

    def differ(self, a, b, what):
        p = psnr(a, b)
        self.check(p < PSNR_MIN, "%s: PSNR %.2f dB (< %.0f)" % (what, p, PSNR_MIN))

    def checkpoint_title(self, filename):
        for m in call(self.url, "/sdapi/v1/sd-models"):
            if os.path.basename(m["filename"]) == filename:
                return m["title"]
        raise SystemExit("checkpoint %s not listed by /sdapi/v1/sd-models" % filename)

    def run(self):
        self.check_options()
        img_on = self.check_kernels()
        self.check_precision(img_on)
        self.set(sd_accel_enabled=False)
        s = self.status()
        self.check(s["patched"] == 0, "toggle off: nothing patched at the next generation (%d)" % s["patched"])
        img_off, ran = self.txt2img("SD Accel off")
        self.check(not any(e["calls"] for e in ran.values()), "off: no SD Accel module called")
        self.same(img_on, img_off, "on vs off")
        self.set(sd_accel_enabled=True)
        self.check_lora(img_on)
        self.check_switch(img_on)
        self.check_hires()
        self.check_controlnet(img_on)
        self.check_multidiffusion()
        self.check_freeu(img_on)
        self.check_late_wrapper(img_on)

    def check_options(self):
        opts = call(self.url, "/sdapi/v1/options")
        self.check(all(k in opts for k in KEYS), "GET /sdapi/v1/options (%d keys) lists %s" % (
            len(opts), {k: opts.get(k, "MISSING") for k in KEYS}))
        if not opts.get("sd_accel_enabled", True):
            self.set(sd_accel_enabled=True)
        s = self.wait_status()
        self.check(s["forge"] is True, "status before the first generation: forge %s, model %s" % (s["forge"], s["model"]))
        self.check(s["settings"] == {"section": "SD Accel", "category": "Stable Diffusion"},
                   "settings filed under %s" % s["settings"])

    def check_kernels(self):
        img, ran = self.txt2img("SD Accel on (default settings)")
        s = self.status()
        print("[status] %s" % json.dumps({k: s.get(k) for k in ("model", "patched", "counts", "skipped", "fold_silu",
                                                               "wrapper", "runs", "graphs")}), flush=True)
        counts = s["counts"]
        self.check(s["patched"] > 0 and sum(counts.values()) == s["patched"] and counts.get("geglu", 0) > 0,
                   "default settings: %d modules patched, per-op counts %s add up, GEGLU on Forge's Linear included"
                   % (s["patched"], counts))
        want = {op: self.args.steps * counts.get(op, 0) for op in OPS}
        got = module_calls(ran)
        self.check(got == want and all(want.values()), "every fused module called on every step: calls %s = "
                   "%d steps x modules" % (got, self.args.steps))
        blocks = block_calls(ran, counts, self.args.steps)
        self.check(all(c == w for c, w in blocks.values()),
                   "every fused block called on every step: {block: (calls, steps x blocks x ops per block)} %s"
                   % blocks)
        g = s["graphs"]
        self.check(s["wrapper"] == "model_function_wrapper" and g.get("eager", 0) + g.get("replays", 0) >= self.args.steps,
                   "the step ran through SD Accel's model_function_wrapper (graphs %s)" % g)
        if self.args.expect_fused:
            self.check(all(ran.get(op, {}).get("fused", 0) > 0 for op in OPS),
                       "the Triton kernels ran: %s" % {op: ran.get(op, {}).get("fused", 0) for op in OPS})
        img2, ran2 = self.txt2img("SD Accel on, again")
        self.check(module_calls(ran2) == want, "the counts rise by as much at the next generation")
        self.same(img, img2, "the same generation twice")
        return img

    def check_precision(self, plain):
        """precision fp8 is not offered on Forge: the status says so in one line and the image is fp16's."""
        self.set(sd_accel_precision="fp8")
        img, _ = self.txt2img("precision fp8 asked for on Forge")
        s = self.status()
        self.check(s.get("precision") == "fp16" and "not offered on Forge" in s.get("reasons", {}).get("precision fp8", ""),
                   "precision fp8 on Forge: runs %s, reason %s" % (s.get("precision"), s.get("reasons")))
        self.same(plain, img, "precision fp8 asked for vs fp16")
        self.set(sd_accel_precision="fp16")

    def check_lora(self, plain):
        on, _ = self.txt2img("LoRA on SD Accel's modules, SD Accel on", lora=True)
        self.differ(on, plain, "the LoRA changes the image")
        self.set(sd_accel_enabled=False)
        off, _ = self.txt2img("LoRA, SD Accel off", lora=True)
        self.same(on, off, "LoRA: SD Accel on vs off (Forge keeps the merged LoRA across the toggle)")
        self.set(sd_accel_enabled=True)
        again, _ = self.txt2img("LoRA, SD Accel on again", lora=True)
        self.same(on, again, "LoRA: SD Accel on again")
        back, _ = self.txt2img("LoRA removed, SD Accel on")
        self.same(back, plain, "LoRA removed: the plain image again")

    def check_switch(self, plain):
        t1, t2 = self.checkpoint_title(self.ckpt), self.checkpoint_title(self.ckpt2)
        self.set(sd_model_checkpoint=t2)
        img_c, ran = self.txt2img("second checkpoint, SD Accel on")
        s = self.status()
        self.check(s["patched"] > 0 and any(e["calls"] for e in ran.values()) and s["state_dict_keys_unchanged"],
                   "checkpoint switch to %s: %d patched, called, keys unchanged %s" % (t2, s["patched"],
                                                                                   s["state_dict_keys_unchanged"]))
        self.differ(img_c, plain, "the second checkpoint's weights change the image")
        self.set(sd_accel_enabled=False)
        img_d, _ = self.txt2img("second checkpoint, SD Accel off")
        self.same(img_c, img_d, "second checkpoint: on vs off")
        self.set(sd_accel_enabled=True, sd_model_checkpoint=t1)
        img_e, _ = self.txt2img("first checkpoint again, SD Accel on")
        self.same(img_e, plain, "back to the first checkpoint")

    def check_hires(self):
        on, ran = self.txt2img("hires fix, SD Accel on", hires=True)
        per_step = self.status()["counts"].get("layer_norm", 0)
        got = module_calls(ran)["layer_norm"]
        self.check(got == (self.args.steps + HR_STEPS) * per_step > 0,
                   "hires fix: SD Accel modules called in the second pass too (%d LayerNorm calls: %d steps x %d)"
                   % (got, self.args.steps + HR_STEPS, per_step))
        self.set(sd_accel_enabled=False)
        off, _ = self.txt2img("hires fix, SD Accel off", hires=True)
        self.set(sd_accel_enabled=True)
        self.same(on, off, "hires fix: on vs off")

    def control_unit(self):
        """A ControlNet unit as the API takes it: the random ControlNet, no preprocessor, a seeded noise image."""
        names = call(self.url, "/controlnet/model_list")["model_list"]
        model = next((n for n in names if n.split(" [")[0] == self.controlnet), None)
        if model is None:
            raise SystemExit("ControlNet %s not listed by /controlnet/model_list: %s" % (self.controlnet, names))
        rng = random.Random(5)
        png = encode_png(64, 64, bytes(rng.randrange(256) for _ in range(64 * 64 * 3)))
        return {"enabled": True, "module": "None", "model": model, "weight": 1.0,
                "image": base64.b64encode(png).decode(), "resize_mode": "Just Resize",
                "processor_res": 64, "guidance_start": 0.0, "guidance_end": 1.0, "control_mode": "Balanced",
                "pixel_perfect": False}

    def check_controlnet(self, plain):
        unit = self.control_unit()
        on, ran = self.txt2img("ControlNet, SD Accel on", control=unit)
        self.differ(on, plain, "the ControlNet changes the image")
        s = self.status()
        cns = [c for c in s.get("controlnets", []) if c["last"] == "accelerated"]
        print("[status] controlnets %s" % json.dumps(s.get("controlnets")), flush=True)
        self.check(len(cns) == 1 and cns[0]["patched"] > 0 and cns[0]["counts"].get("geglu", 0) > 0,
                   "the ControlNet's control model runs SD Accel's modules: %s" % s.get("controlnets"))
        cn = cns[0]["counts"] if cns else {}
        want = {op: self.args.steps * (s["counts"].get(op, 0) + cn.get(op, 0)) for op in OPS}
        got = module_calls(ran)
        self.check(got == want, "with a ControlNet: every fused module of the UNet and of the control model called "
                   "on every step: calls %s = %d steps x modules" % (got, self.args.steps))
        self.set(sd_accel_enabled=False)
        off, _ = self.txt2img("ControlNet, SD Accel off", control=unit)
        self.set(sd_accel_enabled=True)
        self.same(on, off, "ControlNet: on vs off")
        again, _ = self.txt2img("ControlNet removed, SD Accel on")
        self.same(again, plain, "ControlNet removed: the plain image again")

    def check_multidiffusion(self):
        """Forge's MultiDiffusion sets its own model_function_wrapper, which calls the UNet once per batch of tiles:
        SD Accel's wrapper must run inside it (each tile batch through SD Accel's step), never be replaced by it."""
        # 64x64 pixels (8x8 latent) in 32-pixel tiles, no overlap (MultiDiffusion caps it at the tile less 4 latent
        # pixels): 2x2 tiles in batches of 2, so 2 UNet calls per step where one would run without it
        tiles = (32, 32, 0, 2)
        w0 = self.status()["wrapper_calls"]
        on, ran = self.txt2img("MultiDiffusion, SD Accel on", tiles=tiles)
        s = self.status()
        calls = s["wrapper_calls"] - w0
        print("[status] wrapper %s, %d calls through it" % (s.get("wrapper"), calls), flush=True)
        self.check(calls > self.args.steps and calls % self.args.steps == 0,
                   "MultiDiffusion: SD Accel's step runs inside its wrapper, per tile batch (%d calls in %d steps; "
                   "wrapper %s)" % (calls, self.args.steps, s.get("wrapper")))
        per_step = s["counts"].get("layer_norm", 0)
        got = module_calls(ran)["layer_norm"]
        self.check(got == calls * per_step > 0, "MultiDiffusion: the fused modules run in each of those calls "
                   "(%d LayerNorm calls = %d calls x %d)" % (got, calls, per_step))
        self.set(sd_accel_enabled=False)
        off, _ = self.txt2img("MultiDiffusion, SD Accel off", tiles=tiles)
        self.set(sd_accel_enabled=True)
        self.same(on, off, "MultiDiffusion: on vs off")

    def check_freeu(self, plain):
        """Forge's built-in FreeU with a schedule ending at half the steps: its patch reads a flag the extension
        sets before each step (graph keys read it), and its own copy of the filter is recognised as FreeU's: each
        call goes through SD Accel's op (on the CPU the op hands it back to Forge's filter, and says why). On vs
        off the same image."""
        on, ran = self.txt2img("FreeU scheduled, SD Accel on", freeu=FREEU_ARGS)
        op = ran.get("freeu_filter", {"calls": 0, "fused": 0})
        self.check(op["calls"] > 0, "FreeU: Forge's filter calls go through SD Accel's op (%d, %d in the kernel)"
                   % (op["calls"], op["fused"]))
        if self.args.expect_fused:
            self.check(op["fused"] == op["calls"] > 0, "FreeU: every filter call ran the kernel (%d of %d)"
                       % (op["fused"], op["calls"]))
        self.differ(on, plain, "FreeU: it changes the image")
        self.set(sd_accel_enabled=False)
        off, _ = self.txt2img("FreeU scheduled, SD Accel off", freeu=FREEU_ARGS)
        self.set(sd_accel_enabled=True)
        self.same(on, off, "FreeU: on vs off")

    def check_late_wrapper(self, plain):
        """An extension loaded after SD Accel replaces its model_function_wrapper: the UNet's calls then come
        without SD Accel's step, and hooks around them still give each SD Accel's eager path."""
        s0 = self.status()
        on, ran = self.txt2img("late wrapper, SD Accel on", late_wrapper=True)
        s = self.status()
        outside, through = (s["outside_step"]["calls"] - s0["outside_step"]["calls"],
                            s["wrapper_calls"] - s0["wrapper_calls"])
        self.check(outside == self.args.steps and through == 0,
                   "late wrapper: each UNet call outside SD Accel's step goes through its hooks (%d of %d steps; %d "
                   "through its wrapper; status %s)" % (outside, self.args.steps, through, s["outside_step"]))
        per_step = s["counts"].get("layer_norm", 0)
        got = module_calls(ran)["layer_norm"]
        self.check(got == self.args.steps * per_step > 0, "late wrapper: the eager path (held to the fused modules "
                   "here) runs them on every step (%d LayerNorm calls)" % got)
        self.same(on, plain, "late wrapper: the image without it")

    def check_log(self, path):
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if "SD Accel" in ln or "cast_bias_weight" in ln]
        print("[forge log] %d SD Accel lines:" % len(lines))
        for ln in lines:
            print("  " + ln[-300:])
        self.check(not any("None" in ln or "cast_bias_weight" in ln for ln in lines),
                   "console lines without None and without comfy.ops noise")
