"""Bytes of a sparse push's positions under compact codings, in NumPy.

A top-k push sends, per tensor of `n` entries, the positions of its `k` kept
entries. Shorter codes than int32 change how the positions are written, not
which are sent, so a byte model chooses among them; the cluster sends the
one `wire_coding` names (`position_wire` is its TensorFlow side):

* `"int32"`: `4 * k` bytes.
* `"chunk12"`: positions relative to chunks of 4,096 entries, 12 bits each,
  packed (Templar's `pack12`), plus a 2-byte count per chunk:
  `ceil(12 * k / 8) + 2 * ceil(n / 4096)`.
* `"chunk16"`: relative to chunks of 65,536, 16 bits each, plus a 4-byte
  count per chunk when there are several: `2 * k`, plus `4 * ceil(n / 65536)`
  when `n > 65536` (the positions grouped by chunk, `wire_order`).
* `"bitmap"`: one bit per entry: `ceil(n / 8)`.
* `"rice"`: the sorted positions' gaps (`p_0`, then `p_i - p_(i-1) - 1`),
  each in Rice code with parameter `b` (the quotient `g >> b` in unary and
  its stop bit, then `b` low bits), `b` the one giving the fewest bits; a
  byte for `b` and 4 for `k`: `5 + ceil((sum(g >> b) + k * (1 + b)) / 8)`.
* `"auto"`: per tensor the fewest of `chunk12`, `bitmap` and `rice`, plus one
  byte naming the coding.
* `"wire"`: the coding the cluster sends for the tensor (`wire_coding`).

The wire sends `chunk16` for every tensor. A bitmap (smaller above 1/16 of
the entries kept) and Rice's gaps (smaller at 1%) give the positions in
increasing order, not in top-k's, and the kept values are sent (and
quantised a chunk at a time) in the positions' order: the sent values would
change. `chunk16` keeps top-k's order within each chunk of 65,536.

At 1% density Rice takes about 1.1 bytes per position, 12 bits 1.5; a bitmap
wins above about 8% (`1 / 12` of the entries kept). Pure: no TensorFlow.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief import checks

__all__ = [
    "CODINGS",
    "WIRE_CHUNK",
    "chunk16_counts",
    "position_nbytes",
    "rice_nbytes",
    "wire_coding",
    "wire_order",
]

# The codings `position_nbytes` knows (module docstring).
CODINGS = ("int32", "chunk12", "chunk16", "bitmap", "rice", "auto", "wire")
# Entries per chunk of the 12- and 16-bit chunk-relative codes: 2**bits.
_CHUNK12, _CHUNK16 = 4096, 65536
# Entries per chunk of the coding on the wire (`chunk16`).
WIRE_CHUNK = _CHUNK16
# Bytes of a chunk's count in `chunk16`.
_COUNT_BYTES = 4
# The Rice code's header: a byte for its parameter, an int32 count.
_RICE_HEADER_BYTES = 5
# The largest Rice parameter tried: gaps in a tensor of up to 2**31 entries.
_MAX_RICE_PARAMETER = 31


def rice_nbytes(positions: np.ndarray) -> int:
    """Bytes of `positions` (distinct, any order) in the `"rice"` code.

    Args:
      positions: the kept entries' flat indices, a 1-D integer array.

    Returns:
      The header's 5 bytes and the gaps' bits rounded up to whole bytes.
    """
    p = np.sort(np.asarray(positions, np.int64).reshape(-1))
    if p.size == 0:
        return _RICE_HEADER_BYTES
    gaps = np.diff(p, prepend=-1) - 1
    bits = min(
        int(np.sum(gaps >> b)) + p.size * (1 + b)
        for b in range(_MAX_RICE_PARAMETER + 1)
    )
    return _RICE_HEADER_BYTES + -(-bits // 8)


def wire_coding(size: int, count: int) -> str:
    """The coding the cluster sends a tensor's positions in (module docstring).

    Args:
      size: the tensor's entries, `n`.
      count: the positions a push sends, `k` (fixed per tensor).

    Returns:
      One of `CODINGS`: `"chunk16"`.
    """
    del size, count  # The same coding at every size (module docstring).
    return "chunk16"


def chunk16_counts(size: int) -> int:
    """Per-chunk counts `chunk16` sends for a tensor of `size` entries: 0 for
    one chunk (`size <= 65536`), else `ceil(size / 65536)`."""
    return -(-size // _CHUNK16) if size > _CHUNK16 else 0


def wire_order(positions: np.ndarray, size: int) -> np.ndarray:
    """`positions` in the order the wire sends them: grouped by chunk of
    `WIRE_CHUNK` entries, in their given order within a chunk (stable).

    A tensor of one chunk keeps its order. The kept values are sent in the
    same order.

    Args:
      positions: flat indices, a 1-D integer array.
      size: the tensor's entries.

    Returns:
      The reordered positions (`positions` itself for one chunk).
    """
    if size <= WIRE_CHUNK:
        return positions
    chunks = np.asarray(positions) // WIRE_CHUNK
    return positions[np.argsort(chunks, kind="stable")]


def position_nbytes(positions: np.ndarray, size: int, coding: str) -> int:
    """Bytes of a push's `positions` in a tensor of `size` entries.

    Args:
      positions: the kept entries' flat indices, a 1-D integer array.
      size: the tensor's entries, `n`.
      coding: one of `CODINGS` (module docstring).

    Returns:
      The bytes, an int.

    Raises:
      ArgumentError: `coding` is not one of `CODINGS`.
    """
    if coding not in CODINGS:
        raise checks.argument_error("coding", f"one of {CODINGS}", coding)
    k = int(np.asarray(positions).size)
    if coding == "wire":
        coding = wire_coding(size, k)
    chunk12 = -(-12 * k // 8) + 2 * -(-size // _CHUNK12)
    bitmap = -(-size // 8)
    if coding == "int32":
        return 4 * k
    if coding == "chunk12":
        return chunk12
    if coding == "chunk16":
        return 2 * k + _COUNT_BYTES * chunk16_counts(size)
    if coding == "bitmap":
        return bitmap
    rice = rice_nbytes(positions)
    if coding == "rice":
        return rice
    return 1 + min(chunk12, bitmap, rice)
