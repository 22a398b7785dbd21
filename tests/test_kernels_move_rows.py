"""The Triton row move (`kernels.triton.move_rows`) against the reference of `oscar_hf::gather_rows`.

Runs on CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there) and on a CUDA device.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when this file runs alone)

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf.kernels.ops import _gather_rows_reference  # noqa: E402
from oscar_hf.kernels.triton.interpreter import kernel_device  # noqa: E402
from oscar_hf.kernels.triton.move_rows import move_rows  # noqa: E402

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second

DEVICE = kernel_device()
SINK, RECENT, BLOCK, DIM = 4, 11, 3, 40  # a head dim that is not a multiple of the kernel's column block


def _buffers(batch: int, dtype):
    g = torch.Generator().manual_seed(batch)
    shape = (batch, 2, SINK + RECENT + BLOCK, DIM)
    return [torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(2)]


def _window(advance: int) -> torch.Tensor:
    return torch.arange(SINK + advance, SINK + advance + RECENT, device=DEVICE)[None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("advance", [0, BLOCK])
def test_the_window_shift_moves_each_row_down_once(dtype, advance):
    got, want = _buffers(2, dtype), _buffers(2, dtype)
    move_rows(got, _window(advance), SINK)
    _gather_rows_reference(want, _window(advance), SINK)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if advance:  # the rows moved are the ones the block left behind, not a copy the kernel overwrote first
        assert not torch.equal(got[0], _buffers(2, dtype)[0])


@pytest.mark.parametrize("block_rows", [1, 4, 16])
def test_tiles_shorter_than_the_move_give_the_same_rows(block_rows):
    """Sink and window in tiles that split both (and a last tile that is part empty): each tile's sources are read
    before its stores, and no source is an earlier tile's destination."""
    moved = torch.tensor([[1], [3]], device=DEVICE)
    sink = torch.arange(SINK, device=DEVICE)[None] + moved
    index = torch.cat([sink, _window(BLOCK).expand(2, -1)], dim=1).contiguous()
    got, want = _buffers(2, torch.bfloat16), _buffers(2, torch.bfloat16)
    move_rows(got, index, 0, block_rows=block_rows)
    _gather_rows_reference(want, index, 0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_padded_rows_sink_and_window_move_together_and_one_buffer_alone():
    """Per row: a sink that takes real tokens from the block (row 1 hands 2 pads to the history), then the
    window, in one index `[B, S + R]`; a single buffer takes the same move."""
    moved = torch.tensor([[0], [2]], device=DEVICE)
    sink = torch.arange(SINK, device=DEVICE)[None] + moved
    index = torch.cat([sink, _window(BLOCK).expand(2, -1)], dim=1).contiguous()
    got, want = _buffers(2, torch.float32), _buffers(2, torch.float32)
    move_rows(got, index, 0)
    _gather_rows_reference(want, index, 0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    single = _buffers(2, torch.float32)[:1]
    move_rows(single, index, 0)
    assert torch.equal(single[0], want[0])


def test_buffers_of_two_layouts_are_refused():
    a, b = _buffers(2, torch.float32)
    with pytest.raises(ValueError, match="one shape and layout"):
        move_rows([a, b[:1]], _window(0), SINK)
