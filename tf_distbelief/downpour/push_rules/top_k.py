"""Top-k pushes: a replica sends only the largest-magnitude entries.

Gradient sparsification with error feedback (Stich et al. NeurIPS 2018,
"Sparsified SGD with Memory"; Lin et al. ICLR 2018, "Deep Gradient
Compression"). Settings (`DownpourConfig` keyword arguments and launch
flags):

* `top_k_fraction`: None (default): off. A float in `(0, 1]`: of each pushed
  tensor (the gradient sum, or the pseudo-gradient with the outer optimizer),
  flattened and cut into chunks of `top_k_chunk` consecutive entries, a push
  sends from each chunk of `m` entries the `k = max(1, round(fraction * m))`
  of largest magnitude (ties: the lower position first), as positions
  (`downpour.position_wire`: 2 bytes each, grouped by chunk of 65,536
  entries, with a 4-byte count per such chunk in a larger tensor) and their
  values; the rest is 0 on the ps. The replica's residual keeps
  what was not sent and adds it to its next push (`compression`); with the
  outer rule the replica's cache keeps it, and fetches replay the ps's log
  of pushes (`downpour.stream_fetch`).
* `top_k_chunk`: the chunk length, an integer >= 0; 0 (default): the whole
  tensor is one chunk. Chunks spread the kept entries over the tensor.

Bytes per push of a tensor of `n` entries: `k * (2 + itemsize)` summed over
its chunks, plus `4 * ceil(n / 65536)` when `n > 65536`
(`position_codes.position_nbytes`, `"wire"`), less with a quantiser on the
values (`quantize`). TensorFlow is imported by the TF
hook only.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief import checks
from tf_distbelief.downpour.push_rules import rule

__all__ = ["RULE", "TopK", "chunk_counts"]


def chunk_counts(size: int, chunk: int, fraction: float) -> list[tuple[int, int]]:
    """`(chunk length, entries kept)` of each chunk of a tensor, in order.

    Args:
      size: the tensor's entries.
      chunk: `top_k_chunk` (0: one chunk).
      fraction: `top_k_fraction`.
    """
    chunk = chunk or size
    lengths = [chunk] * (size // chunk) + ([size % chunk] if size % chunk else [])
    return [(m, max(1, round(fraction * m))) for m in lengths]


class TopK(rule.PushRule):
    """The top-k entries of each pushed tensor (module docstring).

    Args:
      config: a `DownpourConfig` with `top_k_fraction` set.
    """

    name = "top_k_fraction"
    title = "top-k pushes"
    settings = (
        rule.Setting(
            "top_k_fraction",
            None,
            "float",
            "Downpour push rule (top-k with error feedback): each push sends this "
            "fraction of each tensor's entries, the largest in magnitude; the rest "
            "waits in the replica's residual; in (0, 1] (unset: off).",
        ),
        rule.Setting(
            "top_k_chunk",
            0,
            "int",
            "Downpour: top-k keeps its fraction of each chunk of this many "
            "entries (0: of the whole tensor).",
            lower_bound=0,
        ),
    )
    selects = True

    def __init__(self, config):
        super().__init__(config)
        self.fraction = float(config.top_k_fraction)
        self.chunk = int(config.top_k_chunk)

    @classmethod
    def is_on(cls, config) -> bool:
        return config.top_k_fraction is not None

    @classmethod
    def check(cls, config) -> None:
        fraction = config.top_k_fraction
        rule.check_int("top_k_chunk", config.top_k_chunk, 0, "0: the whole tensor")
        if fraction is None:
            return
        # One message for every value outside (0, 1], NaN included (the
        # launch flag has no bounds of its own: absl's are closed intervals).
        rule.check_float("top_k_fraction", fraction, "None (off)")
        if not 0 < fraction <= 1:
            raise checks.argument_error(
                "top_k_fraction",
                "in (0, 1] (the fraction of entries a push sends) or None (off)",
                fraction,
            )
        rule.check_compressible(config, "top_k_fraction")

    def sent_count(self, size):
        return sum(k for _, k in chunk_counts(size, self.chunk, self.fraction))

    def reference_select(self, flat):
        kept, start = [], 0
        for m, k in chunk_counts(flat.size, self.chunk, self.fraction):
            magnitudes = -np.abs(flat[start : start + m])
            kept.append(np.argsort(magnitudes, kind="stable")[:k] + start)
            start += m
        return np.concatenate(kept)

    def select(self, flat):
        import tensorflow as tf

        size = flat.shape.num_elements()
        counts = chunk_counts(size, self.chunk, self.fraction)
        kept, start = [], 0
        # Full chunks share `k`: one `top_k` over them as rows.
        full = [c for c in counts if c == counts[0]]
        m, k = counts[0]
        rows = tf.reshape(tf.abs(flat[: len(full) * m]), [len(full), m])
        _, positions = tf.math.top_k(rows, k, sorted=True)
        offsets = tf.range(len(full), dtype=tf.int32)[:, None] * m
        kept.append(tf.reshape(positions + offsets, [-1]))
        start = len(full) * m
        for m, k in counts[len(full) :]:  # The shorter last chunk.
            _, positions = tf.math.top_k(tf.abs(flat[start : start + m]), k)
            kept.append(positions + start)
            start += m
        return tf.concat(kept, 0) if len(kept) > 1 else kept[0]


RULE = TopK
