"""fourier_low_scale against FreeU's filter as its authors define it (fp32 FFT, the centred window of the
shifted spectrum scaled, the inverse FFT's real part), over SD skip shapes scaled down for the interpreter, odd
sides, both memory formats and a strided view; its reference over other thresholds and sides of 1."""
import pytest
import torch

from sd_accel.kernels.fourier_low_scale import eligible, fourier_low_scale, fourier_low_scale_reference

CL = torch.channels_last


def freeu_definition(x, threshold, scale):
    spectrum = torch.fft.fftshift(torch.fft.fftn(x.float(), dim=(-2, -1)), dim=(-2, -1))
    mask = torch.ones(spectrum.shape)
    row, col = spectrum.shape[-2] // 2, spectrum.shape[-1] // 2
    mask[..., row - threshold:row + threshold, col - threshold:col + threshold] = scale
    spectrum = torch.fft.ifftshift(spectrum * mask.to(spectrum.device), dim=(-2, -1))
    return torch.fft.ifftn(spectrum, dim=(-2, -1)).real.to(x.dtype)


SHAPES = [
    pytest.param((2, 40, 8, 8), id="skip-8x8"),
    pytest.param((2, 20, 16, 16), id="skip-16x16"),
    pytest.param((1, 5, 7, 9), id="odd-sides"),
    pytest.param((2, 3, 2, 2), id="2x2-every-mode"),
    pytest.param((1, 6, 2, 5), id="side-2"),
    pytest.param((1, 4, 48, 40), id="many-splits"),
]
DTYPES = [
    pytest.param(torch.float32, 2e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1.6e-2, id="bf16"),
]


def _input(shape, dtype, device, channels_last=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    # skip features carry a large per-plane mean and slow gradients, what the low modes are
    n, c, h, w = shape
    ramp = torch.linspace(-1, 1, h)[:, None] + torch.linspace(0, 2, w)[None, :]
    x = torch.randn(shape, generator=g) + 3 * torch.randn(n, c, 1, 1, generator=g) + ramp
    x = x.to(device=device, dtype=dtype)
    return x.contiguous(memory_format=CL) if channels_last else x


def _check(y, x, expected, tol):
    assert fourier_low_scale.last_call.path == "triton", fourier_low_scale.last_call.reason
    assert y.shape == x.shape and y.dtype == x.dtype and y.stride() == torch.empty_like(x).stride()
    torch.testing.assert_close(y.float(), expected.float(), atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_is_freeus_filter(shape, channels_last, dtype, tol, device, poison_empty):
    x = _input(shape, dtype, device, channels_last)
    y = fourier_low_scale(x, threshold=1, scale=0.2)
    _check(y, x, freeu_definition(x, 1, 0.2), tol)


@pytest.mark.parametrize("scale", [0.0, 0.9, 1.0, 2.5])
def test_kernel_at_other_scales(scale, device):
    x = _input((2, 8, 12, 10), torch.float32, device)
    y = fourier_low_scale(x, threshold=1, scale=scale)
    _check(y, x, freeu_definition(x, 1, scale), 2e-5)


def test_kernel_changes_only_the_lowest_modes(device):
    """The output's spectrum: the mean scaled by `scale`; the window's three other modes and their mirror images
    by (1 + scale) / 2 (the real part of the filtered planes keeps half of a change made to one side only); every
    other mode as it was."""
    x = _input((1, 3, 10, 12), torch.float32, device, seed=3)
    y = fourier_low_scale(x, threshold=1, scale=0.5)
    assert fourier_low_scale.last_call.path == "triton"
    fx, fy = torch.fft.fft2(x.double()), torch.fft.fft2(y.double())
    expected = fx.clone()
    expected[..., 0, 0] *= 0.5
    for k, l in [(0, -1), (-1, 0), (-1, -1), (0, 1), (1, 0), (1, 1)]:
        expected[..., k, l] *= 0.75
    torch.testing.assert_close(fy, expected, atol=2e-3, rtol=2e-5)
    assert not torch.allclose(fy, fx, atol=1e-1)


def test_kernel_reads_a_strided_view(device):
    base = _input((2, 16, 9, 11), torch.float16, device, channels_last=True)
    x = base[:, ::2]
    y = fourier_low_scale(x, threshold=1, scale=0.2)
    assert fourier_low_scale.last_call.path == "triton"
    torch.testing.assert_close(y.float(), freeu_definition(x, 1, 0.2).float(), atol=8e-3, rtol=2e-3)


def test_kernel_gives_the_same_bits_every_call(device):
    x = _input((2, 24, 32, 24), torch.float16, device, channels_last=True)
    first = fourier_low_scale(x, threshold=1, scale=0.2)
    assert torch.equal(first, fourier_low_scale(x, threshold=1, scale=0.2))


@pytest.mark.parametrize("shape, threshold", [
    pytest.param((1, 3, 8, 8), 2, id="threshold-2"),
    pytest.param((1, 3, 8, 8), 0, id="threshold-0"),
    pytest.param((1, 3, 1, 6), 1, id="height-1"),
    pytest.param((1, 3, 5, 1), 1, id="width-1"),
    pytest.param((1, 3, 3, 3), 2, id="window-wider-than-half"),
])
def test_what_the_kernels_do_not_take_runs_the_reference(shape, threshold, device):
    x = _input(shape, torch.float32, device)
    y = fourier_low_scale(x, threshold=threshold, scale=0.3)
    assert fourier_low_scale.last_call.path == "reference"
    assert not eligible(x, threshold, 0.3)[0]
    torch.testing.assert_close(y, freeu_definition(x, threshold, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(2, 4, 8, 8), (1, 2, 7, 5), (1, 2, 1, 1), (1, 1, 2, 3)])
@pytest.mark.parametrize("threshold", [0, 1, 2, 3])
def test_reference_is_freeus_filter(shape, threshold):
    x = _input(shape, torch.float32, "cpu")
    torch.testing.assert_close(fourier_low_scale_reference(x, threshold, 0.2), freeu_definition(x, threshold, 0.2),
                               atol=1e-5, rtol=1e-5)
