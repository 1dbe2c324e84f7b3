"""Downpour's dense variables: cached, fetched and pushed whole.

Dean et al. 2012, section 4.1. A fetch copies each variable from its ps task
into the replica's cache; a push sends the gradients summed since the last
push. Inside a `tf.cond` branch (a fetch or a push that not every step
makes) the variables of one ps task and dtype travel as one packed tensor
(`DenseVariables.groups`): the branch not taken still exchanges a dead-tensor
message per cross-device edge at every step, so one edge per group instead of
one per variable makes the steps between fetches and pushes cheaper.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.downpour import base
from tf_distbelief.downpour import plan as plan_lib

__all__ = ["DenseVariables", "pack_flat", "unpack_flat"]


def pack_flat(tensors):
    """One flat tensor of `tensors` (a single tensor is only flattened)."""
    flat = [tf.reshape(x, [-1]) for x in tensors]
    return flat[0] if len(flat) == 1 else tf.concat(flat, 0)


def unpack_flat(packed, shapes):
    """Splits `pack_flat`'s output back into tensors of `shapes`."""
    if len(shapes) == 1:
        return [tf.reshape(packed, shapes[0])]
    sizes = [s.num_elements() for s in shapes]
    return [tf.reshape(x, s) for x, s in zip(tf.split(packed, sizes), shapes)]


class DenseVariables(base.VariableKind):
    """The dense variables of a replica (see `base.VariableKind`).

    Attributes:
      nbytes: bytes of the variables, what one fetch or one push (of the
        gradients alone) moves.
    """

    kind = "dense"

    def __init__(self, variables: list, plan: plan_lib.Plan):
        super().__init__(variables, plan)
        self.nbytes = sum(v.shape.num_elements() * v.dtype.size for v in variables)

    def _read(self, handle, j, rows):
        return base.read(handle, self.variables[j].dtype)

    def _write(self, handle, rows, value):
        return base.assign(handle, value)

    def _add(self, handle, grad):
        return base.add(handle, grad)

    def _sgd_step(self, cache, grad, alpha):
        return tf.raw_ops.ResourceApplyGradientDescent(
            var=cache, alpha=alpha, delta=grad
        )

    def groups(self) -> list[list[int]]:
        """The variables moved as one tensor each: indices by (device, dtype)."""
        groups = {}
        for j, v in enumerate(self.variables):
            groups.setdefault((v.device, v.dtype), []).append(j)
        return list(groups.values())

    def pull(
        self, kh: base.KindHandles, pack: bool, record=None, records=None
    ) -> list[tf.Tensor]:
        """Reads every variable from the ps; returns worker-side values.

        With `pack` (a fetch in a `tf.cond` branch) each group's values are
        flattened and concatenated on its ps task and split again on the
        worker: one copy of the parameters on each side, traded for one
        transfer, and one dead-tensor message at every step without a fetch,
        per group instead of per variable. An unconditional fetch moves each
        variable as it is.

        Args:
          kh: the kind's handles.
          pack: pack by group, as above.
          record: optional `(j, value on the ps) -> ops`, called with each
            value read (delay compensation's copy of what a replica fetched,
            `push_rules.on_ps.PushRules.record_fetch`); its ops go to `records`.
          records: the list `record`'s ops are appended to.
        """
        if not pack:
            ps_values = [base.read(p, v.dtype) for p, v in zip(kh.ps, self.variables)]
        else:
            ps_values = []
            for p, v in zip(kh.ps, self.variables):
                with tf.device(v.device):
                    ps_values.append(base.read(p, v.dtype))
        if record is not None:
            for j, x in enumerate(ps_values):
                records.extend(record(j, x))
        if not pack:
            return ps_values
        values = [None] * len(self.variables)
        for group in self.groups():
            with tf.device(self.variables[group[0]].device):
                packed = pack_flat([ps_values[j] for j in group])
            shapes = [self.variables[j].shape for j in group]
            for j, part in zip(group, unpack_flat(packed, shapes)):
                values[j] = part
        return values

    def fetch_into_cache(self, kh: base.KindHandles, record=None) -> list:
        """Ops of a fetch in a `tf.cond` branch: packed ps reads into the cache.

        `record` as for `pull`; its ops are among those returned.
        """
        records = []
        values = self.pull(kh, True, record, records)
        return [base.assign(c, x) for c, x in zip(kh.caches, values)] + records

    def cached(self, kh: base.KindHandles) -> list[tf.Tensor]:
        """The cached values (under the caller's control dependencies)."""
        return [base.read(c, v.dtype) for c, v in zip(kh.caches, self.variables)]

    def to_ps(self, grads: list, pack: bool) -> list[tf.Tensor]:
        """`grads` (worker tensors) as tensors on each variable's ps task.

        With `pack`, one message per group, as in `pull`.
        """
        if not pack:
            out = []
            for g, v in zip(grads, self.variables):
                with tf.device(v.device):
                    out.append(tf.identity(g))
            return out
        out = [None] * len(self.variables)
        for group in self.groups():
            packed = pack_flat([grads[j] for j in group])
            shapes = [self.variables[j].shape for j in group]
            with tf.device(self.variables[group[0]].device):
                for j, part in zip(group, unpack_flat(packed, shapes)):
                    out[j] = part
        return out
