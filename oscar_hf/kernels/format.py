"""`RowFormat`: how one history row (one token of one KV head, keys or values) is stored, as one value.

A format is the code width, the encoder that chooses a row's codes and (scale, zero) pair, the pair's dtype, and the
clip ratios of keys and values. It answers every question about its rows: their bytes, their bits per element, the
head sizes it packs, the reference encode and decode (`reference.quantize`), and what a kernel specializes on
(`kernel_key`). `OscarConfig` holds one for ordinary rows and one for high-precision rows; nothing else restates
their arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_hf.kernels.reference.quantize import (
    CODE_SLICES,
    COMPACT,
    ENCODERS,
    code_slices,
    code_bytes,
    codes_per_group,
    dequantize_rows,
    pack_codes,
    quantize_rows,
    row_bytes,
    unpack_codes,
)

PAIR_DTYPES = (torch.float16, torch.bfloat16, torch.float32, COMPACT)


@dataclass(frozen=True)
class RowFormat:
    """One history row's storage (module docstring). Raises ValueError on a width, encoder or pair dtype the
    history cannot store."""

    bits: int = 2
    encoder: str = "minmax"
    pair_dtype: torch.dtype = torch.float16
    key_clip_ratio: float | None = None
    value_clip_ratio: float | None = None

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise ValueError(f"bits={self.bits!r}: expected an int, one of {sorted(CODE_SLICES)}")
        code_slices(self.bits)
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder={self.encoder!r}: expected one of {sorted(ENCODERS)}")
        if self.pair_dtype not in PAIR_DTYPES:
            raise ValueError(f"pair dtype {self.pair_dtype}: expected one of {PAIR_DTYPES}")
        if self.pair_dtype == COMPACT and self.encoder == "lloyd":
            raise ValueError("encoder='lloyd' refines float (scale, zero) pairs; compact pairs take 'minmax' or "
                             "'sigma'")

    # ------------------------------------------------------------------------------------------ bytes
    def code_bytes(self, dim: int) -> int:
        """Bytes of a row's `dim` packed codes."""
        return code_bytes(dim, self.bits)

    def row_bytes(self, dim: int) -> int:
        """Bytes of one row: its packed codes and its (scale, zero) pair."""
        return row_bytes(dim, self.bits, self.pair_dtype)

    def bits_per_element(self, dim: int) -> float:
        return 8.0 * self.row_bytes(dim) / dim

    def unpackable(self, dim: int) -> str | None:
        """Why rows of `dim` elements cannot be packed in this format, or None when they can."""
        group = codes_per_group(self.bits)
        if dim % group:
            return f"head_dim={dim} is not a multiple of {group}, the codes packed per byte at {self.bits} bits"
        return None

    # ------------------------------------------------------------------------------------------ reference codec
    def clip_ratio(self, values: bool) -> float | None:
        return self.value_clip_ratio if values else self.key_clip_ratio

    def encode(self, rows: torch.Tensor, values: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 rows `[..., d]` (rotated) as stored: (packed codes `[..., code_bytes(d)]`, pairs `[..., 2]`)."""
        codes, pairs = quantize_rows(rows, self.bits, self.clip_ratio(values), self.pair_dtype, self.encoder)
        return pack_codes(codes, self.bits), pairs

    def decode(self, packed: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """float32 rows `[..., d]` from what `encode` stored."""
        return dequantize_rows(unpack_codes(packed, self.bits), pairs, self.bits)

    def fake_quantize(self, rows: torch.Tensor, values: bool = False) -> torch.Tensor:
        """Rows as the history reads them back (`encode` then `decode`, without packing)."""
        codes, pairs = quantize_rows(rows, self.bits, self.clip_ratio(values), self.pair_dtype, self.encoder)
        return dequantize_rows(codes, pairs, self.bits)

    # ------------------------------------------------------------------------------------------ kernels
    @property
    def kernel_key(self) -> tuple[int, torch.dtype]:
        """What a kernel reading these rows is specialized on: the code width and the pair dtype."""
        return self.bits, self.pair_dtype

