"""Compressed pushes in TensorFlow: encoded on the replica, decoded on the ps.

A compressing push rule (`rule.PushRule.selects` or `.codes`; `top_k`,
`quantize`) shrinks what a push moves. At a push of `acc` the replica adds its
residual `e` (one `per_worker_variable=True` variable per dense variable, of
its shape and dtype) and encodes `u = acc + e` on its worker: the selecting
rule's positions, grouped by chunk and written as `downpour.position_wire`
writes them (chunk-relative uint16 offsets and per-chunk counts), and the
kept values in the same order, coded by the coding rule if one is on. Only
those tensors cross to the ps, one message per part per ps task and dtype
(each variable's parts concatenated, as `dense.DenseVariables` packs);
the ps decodes them into a dense tensor (0 where nothing was sent) that the
push rules and the ps optimizer apply as any push. The replica decodes the
same tensors, and an applied push sets `e <- u - decoded`; a push dropped
(`max_staleness`), refused (a NaN or inf) or already applied (`exactly_once`)
leaves `e` as it was. The residuals are among the replica's state
(`Downpour.worker_variables`, `dense/residual/j`), checkpointed for an exact
resume. `reference.compress` is the NumPy side. With the outer rule the
residuals are not kept: `downpour.stream_fetch` encodes the mirror less the
cache (`encode_values`) and logs the parts on the ps (`to_ps` returns them).
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.downpour import base, position_wire

__all__ = ["CompressedPush", "create"]


def create(config, variables: list, residuals: bool = True):
    """The `CompressedPush` of `config`'s rules, or None when none compresses.

    Args:
      config: the `DownpourConfig`.
      variables: the dense variables (shards); under the strategy's scope.
      residuals: keep a residual per variable (error feedback); False with
        update-stream fetches, whose residual is the cache (`stream_fetch`).
    """
    if not any(r.compresses for r in config.rules):
        return None
    return CompressedPush(config.rules, variables, residuals)


class CompressedPush:
    """The residuals of a replica's dense variables and the push's coding.

    Create it under the strategy's scope.

    Args:
      rules: the push rules in effect (at least one compresses).
      variables: the dense `DownpourVariable` shards, in the kind's order.
      residuals: keep a per-worker residual per variable (error feedback).

    Attributes:
      residuals: per variable, the per-worker residual (empty without).
      nbytes: bytes one push moves: the encoded tensors' sizes.
    """

    def __init__(self, rules, variables: list, residuals: bool = True):
        self.selector = next((r for r in rules if r.selects), None)
        self.coder = next((r for r in rules if r.codes), None)
        self.variables = list(variables)
        self.residuals = (
            base.per_worker_copies(variables, "residual") if residuals else []
        )
        self.nbytes = 0
        self._specs = []
        for v in self.variables:
            # The encoding's static shapes, traced once in a scratch graph.
            with tf.Graph().as_default():
                parts = self._encode(tf.zeros([v.shape.num_elements()], v.dtype))
                self._specs.append([(x.shape, x.dtype) for x in parts])
                self.nbytes += sum(x.shape.num_elements() * x.dtype.size for x in parts)

    def handles(self) -> list:
        """The residuals' handles; take them at the top of the scheduled function."""
        return [r.handle for r in self.residuals]

    def worker_variables(self) -> dict[str, tf.Variable]:
        """The residuals by `dense/residual/j` (`replica_state` keys)."""
        return {f"dense/residual/{j}": r for j, r in enumerate(self.residuals)}

    def part_specs(self, v) -> list:
        """`(shape, dtype)` of each encoded part of a push of variable `v`."""
        (j,) = [j for j, x in enumerate(self.variables) if x is v]
        return list(self._specs[j])

    def decode(self, parts: tuple, v):
        """Variable `v`'s dense value from one push's encoded `parts`."""
        return self._decode(parts, v)

    def _encode(self, flat) -> tuple:
        """A 1-D tensor's parts to send: the positions' offsets and counts (if
        selecting, `position_wire`), then the values or their codes."""
        positions = ()
        size = flat.shape.num_elements()
        if self.selector is not None:
            kept = position_wire.group(self.selector.select(flat), size)
            positions = position_wire.encode(kept, size)
            flat = tf.gather(flat, kept)
        coded = (flat,) if self.coder is None else tuple(self.coder.encode(flat))
        return positions + coded

    def _decode(self, parts: tuple, v):
        """Variable `v`'s dense value from its sent `parts`."""
        size = v.shape.num_elements()
        count = size
        if self.selector is not None:
            (offsets, counts), parts = parts[:2], parts[2:]
            positions = position_wire.decode(offsets, counts, size)
            count = offsets.shape.num_elements()
        values = (
            parts[0] if self.coder is None else self.coder.decode(parts, count, v.dtype)
        )
        if self.selector is not None:
            values = tf.scatter_nd(positions[:, None], values, [size])
        return tf.reshape(values, v.shape)

    def encode(self, residuals: list, grads: list) -> tuple[list, list, list]:
        """Encodes a push of `grads` on the worker.

        Args:
          residuals: the residuals' handles (`handles`).
          grads: the pushed sums, worker tensors.

        Returns:
          `(unsent, parts, sent)` per variable: `grads` plus the residual, the
          parts to send, and their decoded value (what the ps applies).
        """
        unsent = [
            g + base.read(e, v.dtype)
            for g, e, v in zip(grads, residuals, self.variables)
        ]
        parts, sent = self.encode_values(unsent)
        return unsent, parts, sent

    def encode_values(self, values: list) -> tuple[list, list]:
        """Encodes a push of `values` (worker tensors, one per variable) as
        they are: `(parts, sent)` per variable, as `encode`."""
        parts, sent = [], []
        for u, v in zip(values, self.variables):
            parts.append(self._encode(tf.reshape(u, [-1])))
            sent.append(self._decode(parts[-1], v))
        return parts, sent

    def keep_residuals(self, residuals: list, unsent: list, sent: list) -> list:
        """Ops of an applied push: each residual becomes `unsent - sent`."""
        return [base.assign(e, u - s) for e, u, s in zip(residuals, unsent, sent)]

    def to_ps(self, parts: list, groups: list[list[int]]) -> tuple[list, list]:
        """The pushed values decoded on each variable's ps task.

        Args:
          parts: `encode`'s parts per variable.
          groups: the variables' indices by ps task and dtype
            (`DenseVariables.groups`): each group's parts travel concatenated,
            one tensor per part.

        Returns:
          `(decoded, moved)`: per variable, one dense tensor on its ps task,
          and its parts as received there.
        """
        out = [None] * len(self.variables)
        received = [None] * len(self.variables)
        for group in groups:
            moved = []
            for k in range(len(parts[group[0]])):
                pieces = [parts[j][k] for j in group]
                packed = tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0]
                with tf.device(self.variables[group[0]].device):
                    sizes = [p.shape.num_elements() for p in pieces]
                    moved.append(
                        tf.split(packed, sizes) if len(sizes) > 1 else [packed]
                    )
            with tf.device(self.variables[group[0]].device):
                for i, j in enumerate(group):
                    received[j] = tuple(m[i] for m in moved)
                    out[j] = self._decode(received[j], self.variables[j])
        return out, received
