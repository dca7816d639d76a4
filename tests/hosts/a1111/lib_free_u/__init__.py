"""Stand-in of sd-webui-freeu (ljleb/sd-webui-freeu), the FreeU extension of A1111, as far as its mechanism goes:
at load it sets its own `cat` on A1111's UNet torch proxy (`modules.sd_hijack_unet.th`, a functools.partial over
the proxy's cat), and on every call that hook decides in Python, from its global state (the switch, each stage's
backbone factor and skip scale, a start/stop schedule over the sampling steps), whether to scale half of the
backbone's channels and filter the skip in the frequency domain before concatenating. The package and module
names are the extension's (SD Accel recognises its switch by them); the numbers and stages are the tests'."""
