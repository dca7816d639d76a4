"""Image metrics for bench/quality.py: PSNR always; LPIPS and CLIP score only where their packages (and their
weights, which they download on first use) are available, else the one line that says why not.

Images are ComfyUI's IMAGE tensors: [batch, height, width, channels], floats in 0..1.
"""
import math

import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def psnr(a, b):
    """PSNR in dB of `a` against `b` (0..1 images); inf where they are identical."""
    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _nchw(img):
    return img.float().permute(0, 3, 1, 2).contiguous()


def lpips_scorer():
    """(score(a, b) -> float, None), or (None, why not). LPIPS with AlexNet features, lower is closer."""
    try:
        import lpips
    except ImportError:
        return None, "LPIPS not computed: the `lpips` package is not installed (pip install lpips)"
    try:
        net = lpips.LPIPS(net="alex", verbose=False).eval()
    except Exception as e:  # noqa: BLE001 - no network for its AlexNet weights, a broken install
        return None, "LPIPS not computed: lpips could not load its network (%s)" % _first_line(e)

    def score(a, b):
        with torch.no_grad():
            return float(net(_nchw(a) * 2 - 1, _nchw(b) * 2 - 1).mean())
    return score, None


def clip_scorer(open_clip_name="ViT-B-32/openai", hub_name="openai/clip-vit-base-patch32"):
    """(score(image, text) -> float, None), or (None, why not). CLIP score: 100 * max(cos(image, text), 0),
    higher is closer; open_clip's `open_clip_name` (ARCH/PRETRAINED) first, else transformers' `hub_name`."""
    reasons = []
    for make, model_name in ((_open_clip, open_clip_name), (_transformers_clip, hub_name)):
        try:
            embed = make(model_name)
        except ImportError as e:
            reasons.append(str(e))
            continue
        except Exception as e:  # noqa: BLE001 - weights not downloadable here, an unknown model name
            reasons.append("%s could not load %s (%s)" % (make.__doc__, model_name, _first_line(e)))
            continue

        def score(image, text, embed=embed):
            with torch.no_grad():
                i, t = embed(image, text)
                cos = torch.nn.functional.cosine_similarity(i, t, dim=-1)
                return float((100 * cos.clamp(min=0)).mean())
        return score, None
    return None, "CLIP score not computed: " + "; ".join(reasons)


def _pixels(img, size):
    x = torch.nn.functional.interpolate(_nchw(img), size=size, mode="bicubic", align_corners=False,
                                        antialias=True).clamp(0, 1)
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def _open_clip(model_name):
    """open_clip"""
    try:
        import open_clip
    except ImportError:
        raise ImportError("open_clip is not installed (pip install open_clip_torch)") from None
    arch, _, tag = model_name.partition("/")
    model = open_clip.create_model(arch, pretrained=tag).eval()
    tokenizer = open_clip.get_tokenizer(arch)
    size = model.visual.image_size
    size = size if isinstance(size, (tuple, list)) else (size, size)
    return lambda image, text: (model.encode_image(_pixels(image, size)), model.encode_text(tokenizer([text])))


def _transformers_clip(model_name):
    """transformers"""
    try:
        import transformers
    except ImportError:
        raise ImportError("transformers is not installed") from None
    model = transformers.CLIPModel.from_pretrained(model_name).eval()
    tokenizer = transformers.CLIPTokenizer.from_pretrained(model_name)
    size = (model.config.vision_config.image_size,) * 2

    def embed(image, text):
        tokens = tokenizer([text], padding=True, truncation=True, return_tensors="pt")
        return model.get_image_features(pixel_values=_pixels(image, size)), model.get_text_features(**tokens)
    return embed


def _first_line(e):
    text = str(e).strip().splitlines()
    return "%s: %s" % (type(e).__name__, text[0][:160] if text else "")
