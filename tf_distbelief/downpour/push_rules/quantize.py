"""Low-bit pushes: a replica sends each pushed value in 8 or 2 bits.

Quantisation with error feedback (Seide et al. Interspeech 2014, "1-Bit
Stochastic Gradient Descent"; Karimireddy et al. ICML 2019, "Error Feedback
Fixes SignSGD"). Settings (`DownpourConfig` keyword arguments and launch
flags):

* `quantize_bits`: 0 (default): off; 8 or 2. The sent values (each pushed
  tensor flattened, or the entries top-k keeps, in its order) are cut into
  chunks of `quantize_chunk`; a chunk with scale `s = max |x|` is sent as `s`
  (in the variable's dtype) and a code per value, `q = round(x / s * L)`
  (half to even), `L = 2**(bits - 1) - 1` (127 or 1: int8, or 3 levels
  packed 4 to a byte); the ps applies `q * s / L` (0 where `s` is 0). The
  replica's residual keeps the coding error and adds it to its next push
  (`compression`; with the outer rule the cache keeps it,
  `downpour.stream_fetch`): with 2 bits an entry is sent as `-s`, 0 or `s`.
* `quantize_chunk`: values per scale, an integer >= 1; default 256
  (`QUANTIZE_CHUNK`).

Bytes per push of `n` values: `n` (8 bits) or `ceil(n / 4)` (2 bits), plus
`ceil(n / quantize_chunk)` scales. TensorFlow is imported by the TF hooks only.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief import checks
from tf_distbelief.downpour.push_rules import rule

__all__ = ["BITS", "QUANTIZE_CHUNK", "Quantize", "RULE"]

# The bit widths a value can be sent in (0: off).
BITS = (0, 2, 8)
# Values per scale: a float64 scale per 256 codes is 3% more bytes at 8 bits.
QUANTIZE_CHUNK = 256
# 2-bit codes packed into a byte.
_PER_BYTE = 4


class Quantize(rule.PushRule):
    """Pushed values in `quantize_bits` bits, a scale per chunk (module docstring).

    Args:
      config: a `DownpourConfig` with `quantize_bits` 8 or 2.
    """

    name = "quantize_bits"
    title = "quantised pushes"
    settings = (
        rule.Setting(
            "quantize_bits",
            0,
            "int",
            "Downpour push rule (quantiser with error feedback): each push sends "
            "its values in 8 or 2 bits with a scale per chunk; the coding error "
            "waits in the replica's residual (0: off).",
            lower_bound=0,
        ),
        rule.Setting(
            "quantize_chunk",
            QUANTIZE_CHUNK,
            "int",
            "Downpour: values per scale of the quantiser.",
            lower_bound=1,
        ),
    )
    codes = True

    def __init__(self, config):
        super().__init__(config)
        self.bits = int(config.quantize_bits)
        self.chunk = int(config.quantize_chunk)
        self.levels = 2 ** (self.bits - 1) - 1  # `L`.

    @classmethod
    def check(cls, config) -> None:
        bits = config.quantize_bits
        rule.check_int("quantize_bits", bits, 0, "0 (off), 2 or 8")
        if bits not in BITS:
            raise checks.argument_error("quantize_bits", "one of 0 (off), 2, 8", bits)
        rule.check_int("quantize_chunk", config.quantize_chunk, 1, "values per scale")
        if bits:
            rule.check_compressible(config, "quantize_bits")

    def _chunks(self, count: int) -> int:
        return -(-count // self.chunk)

    def coded_nbytes(self, count, itemsize):
        codes = count if self.bits == 8 else -(-count // _PER_BYTE)
        return codes + self._chunks(count) * itemsize

    def reference_code(self, values):
        out = np.empty_like(values)
        for start in range(0, values.size, self.chunk):
            x = values[start : start + self.chunk]
            s = np.abs(x).max()
            safe = s if s > 0 else np.ones_like(s)
            q = np.round(x / safe * self.levels)
            out[start : start + self.chunk] = q * s / self.levels
        return out

    def _rows(self, values, count):
        """`values` padded with 0 to whole chunks, a row per chunk."""
        import tensorflow as tf

        pad = self._chunks(count) * self.chunk - count
        padded = tf.concat([values, tf.zeros([pad], values.dtype)], 0)
        return tf.reshape(padded, [self._chunks(count), self.chunk])

    def encode(self, values):
        import tensorflow as tf

        count = values.shape.num_elements()
        rows = self._rows(values, count)
        scales = tf.reduce_max(tf.abs(rows), axis=1)
        safe = tf.where(scales > 0, scales, tf.ones_like(scales))
        levels = tf.constant(self.levels, values.dtype)
        q = tf.reshape(tf.round(rows / safe[:, None] * levels), [-1])[:count]
        if self.bits == 8:
            return tf.cast(q, tf.int8), scales
        # Codes -1, 0, 1 as 0, 1, 2: two bits each, 4 to a byte.
        u = tf.cast(q + 1, tf.uint8)
        u = tf.concat([u, tf.zeros([-count % _PER_BYTE], tf.uint8)], 0)
        u = tf.reshape(u, [-1, _PER_BYTE])
        packed = u[:, 0]
        for i in range(1, _PER_BYTE):
            packed = tf.bitwise.bitwise_or(
                packed, tf.bitwise.left_shift(u[:, i], tf.constant(2 * i, tf.uint8))
            )
        return packed, scales

    def decode(self, coded, count, dtype):
        import tensorflow as tf

        codes, scales = coded
        if self.bits == 8:
            q = tf.cast(codes, dtype)
        else:
            shifts = tf.constant([2 * i for i in range(_PER_BYTE)], tf.uint8)
            u = tf.bitwise.right_shift(codes[:, None], shifts[None, :])
            u = tf.bitwise.bitwise_and(u, tf.constant(3, tf.uint8))
            q = tf.cast(tf.reshape(u, [-1])[:count], dtype) - 1
        rows = self._rows(q, count)
        levels = tf.constant(self.levels, dtype)
        return tf.reshape(rows * scales[:, None] / levels, [-1])[:count]


RULE = Quantize
