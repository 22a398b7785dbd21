"""The Triton dequantization of history rows (`kernels.triton.dequantize`) against the reference's
(`reference.attention.history_rows`), for every code width and (scale, zero) format the kernels read.

Runs on CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there) and on a CUDA device.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.history import QuantizedHistory  # noqa: E402
from oscar_hf.kernels.reference.attention import history_rows  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.reference.quantize import COMPACT  # noqa: E402
from oscar_hf.kernels.triton.dequantize import dequantize_history, dequantize_rows  # noqa: E402
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402

DEVICE = kernel_device()
TOKENS = 150  # more than two of the kernel's 64-row blocks, not a multiple of them


def _history(bits, scale_dtype, dim, dtype):
    g = torch.Generator().manual_seed(bits * dim)
    history = QuantizedHistory(2, 3, dim, dim, OscarConfig(bits=bits, scale_dtype=scale_dtype), DEVICE)
    keys = (torch.randn(2, 3, TOKENS, dim, generator=g) * 4).to(dtype).to(DEVICE)
    values = torch.randn(2, 3, TOKENS, dim, generator=g).to(dtype).to(DEVICE)
    history.append(keys, values, None, None, ReferenceBackend())
    return history.kernel_view()


@pytest.mark.parametrize("bits,scale_dtype,dim", [(2, torch.float16, 128), (4, torch.float16, 64),
                                                  (2, torch.bfloat16, 64), (2, torch.float32, 256),
                                                  (2, COMPACT, 128), (4, COMPACT, 64), (3, torch.float16, 128),
                                                  (3, COMPACT, 64)])
@pytest.mark.parametrize("out_dtype", [pytest.param(torch.float32, marks=pytest.mark.quick), torch.bfloat16])
def test_rows_come_back_as_the_reference_reads_them(bits, scale_dtype, dim, out_dtype):
    history = _history(bits, scale_dtype, dim, torch.float32)
    start, stop = 7, TOKENS - 3
    want_keys, want_values = history_rows(history, start, stop)
    keys = torch.full((2, 3, stop - start, dim), float("nan"), dtype=out_dtype, device=DEVICE)
    values = torch.full_like(keys, float("nan"))
    dequantize_history(history, start, keys, values)
    # float pairs: the same float32 product, then one rounding to the output dtype (one bfloat16 step apart at
    # most: Triton's interpreter truncates where torch rounds to nearest); compact pairs: the scale's exponential
    # (exp2 in the kernel, pow in the reference) may differ in its last bit
    rtol = {torch.float32: 0.0 if scale_dtype != COMPACT else 1e-6, torch.bfloat16: 2**-7}[out_dtype]
    for got, want in ((keys, want_keys), (values, want_values)):
        torch.testing.assert_close(got.float(), want.to(out_dtype).float(), rtol=rtol, atol=1e-6)


@pytest.mark.quick
def test_rows_outside_the_codes_are_refused():
    history = _history(2, torch.float16, 64, torch.float32)
    out = torch.empty(2, 3, 10, 64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_rows(history.keys, history.key_scale_zero, 2, history.keys.shape[2] - 5, out)
    with pytest.raises(ValueError, match="do not give rows"):
        dequantize_rows(history.keys, history.key_scale_zero, 4, 0, out)
