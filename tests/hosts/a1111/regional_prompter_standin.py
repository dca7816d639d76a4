"""Stand-in of Regional Prompter's attention mode (hako-mikan/sd-webui-regional-prompter): its own `forward` set on
every cross-attention before a generation, counting its calls and switching sides once every hooked layer has run
(the extension: every 16 calls, SD1.5's cross-attentions), here the context halved on every other UNet call: Python
state a replay would neither read nor advance."""


def hook_forwards(unet, calls):
    """Sets the forwards on `unet`'s cross-attentions; `calls` (a list) counts their calls."""
    hooked = [(n, m) for n, m in unet.named_modules() if n.endswith("attn2") and type(m).__name__ == "CrossAttention"]
    for name, module in hooked:
        def forward(x, context=None, mask=None, module=module, **kw):
            scale = 0.5 if (len(calls) // len(hooked)) % 2 == 0 else 1.0
            calls.append(name)
            return type(module).forward(module, x, context * scale, mask, **kw)
        module.forward = forward
