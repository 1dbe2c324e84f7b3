"""Downpour's row-sparse variables: tables fetched and pushed by rows.

Dean et al. 2012, section 4.1, for large embedding tables: a fetch only marks
the replica's cached rows stale; each step fetches the rows its batch looks up
that the replica has not fetched since (a `RowReader`, which the table reads
as during the forward pass), and a push sends the rows touched since the last
push, as `tf.IndexedSlices` to the optimizer's sparse update (see
`downpour.schedule` for the exact order). The replica still holds a cache and
an accumulator of the table's shape (worker memory), but the traffic is rows.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief import checks, substitution
from tf_distbelief.downpour import base
from tf_distbelief.downpour import plan as plan_lib
from tf_distbelief.downpour.variables import RowSparseReadError, leaf_variables
from tf_distbelief.tf_internals import variables as tf_variables

__all__ = ["RowReader", "RowSparseVariables", "flags"]


def flags(variables: list, row_sparse) -> list[bool]:
    """Per variable of `variables` (shards), True if it is in `row_sparse`.

    Args:
      variables: a replica's variables, shards in place of sharded ones.
      row_sparse: a variable (whole or sharded) or a list of them, each of
        rank >= 1 and among `variables` (`replica.Downpour`'s `row_sparse`).

    Raises:
      TypeError: `row_sparse` holds something other than variables.
      ValueError: a `row_sparse` variable is not among `variables`, or is a
        scalar.
    """
    sharded = tf_variables.ShardedVariable
    if isinstance(row_sparse, (tf.Variable, sharded)):
        row_sparse = [row_sparse]
    for v in row_sparse:
        if not isinstance(v, (tf.Variable, sharded)):
            raise checks.argument_error(
                "row_sparse",
                "a list of variables (e.g. `[layer.embeddings]`), not names or layers",
                v,
            )
    known = {id(v) for v in variables}
    leaves = leaf_variables(row_sparse)
    for v in leaves:
        if id(v) not in known or not v.shape.rank:
            raise ValueError(
                "Argument `row_sparse` must hold trained variables of rank >= 1 "
                f"(tables of rows). Received: {v.name} of shape {v.shape}"
            )
    sparse = {id(v) for v in leaves}
    return [id(v) in sparse for v in variables]


class RowSparseVariables(base.VariableKind):
    """The row-sparse variables of a replica (see `base.VariableKind`).

    Each variable has rank >= 1; its rows are indexed along axis 0.

    Attributes:
      row_bytes: bytes of one row of each variable.
    """

    kind = "rows"

    def __init__(self, variables: list, plan: plan_lib.Plan):
        super().__init__(variables, plan)
        self.row_bytes = [v.shape[1:].num_elements() * v.dtype.size for v in variables]
        self.valid, self.touched = [
            [
                base.per_worker(
                    f"downpour/{what}/{base.slug(v.name)}", v.shape[:1], tf.int32
                )
                for v in variables
            ]
            for what in ("valid", "touched")
        ]

    def handles(self) -> base.KindHandles:
        return (
            super()
            .handles()
            ._replace(
                valid=[x.handle for x in self.valid],
                touched=[x.handle for x in self.touched],
            )
        )

    def _worker_lists(self):
        return super()._worker_lists() + [
            ("valid", self.valid),
            ("touched", self.touched),
        ]

    def _read(self, handle, j, rows):
        return base.gather(handle, rows, self.variables[j].dtype)

    def _write(self, handle, rows, value):
        return base.scatter("Update", handle, rows, value)

    def _add(self, handle, grad):
        return base.scatter("Add", handle, grad.indices, grad.values)

    def _sgd_step(self, cache, grad, alpha):
        return base.scatter("Sub", cache, grad.indices, alpha * grad.values)

    def _accumulate(self, kh, j, grad):
        ones = tf.ones_like(grad.indices, tf.int32)
        return super()._accumulate(kh, j, grad) + [
            base.scatter("Update", kh.touched[j], grad.indices, ones)
        ]

    def _pushed_rows(self, kh, j):
        return tf.where(base.read(kh.touched[j], tf.int32) > 0)[:, 0]

    def _restart_rows(self, kh, j):
        return [self._clear(kh.touched[j], j)]

    def _clear(self, handle, j: int):
        """Zeroes a per-row int32 mask (`valid`, `touched`) of variable `j`."""
        return base.assign(handle, tf.zeros(self.variables[j].shape[:1], tf.int32))

    def mark_stale(self, kh: base.KindHandles) -> list:
        """The ops of a fetch: every row is stale now, fetched when read."""
        return [self._clear(valid, j) for j, valid in enumerate(kh.valid)]

    def readers(
        self, kh: base.KindHandles, bytes_fetched, after: list, active=None
    ) -> list[RowReader]:
        """A `RowReader` per variable for one step's forward pass.

        Args:
          kh: the kind's handles.
          bytes_fetched: the handle of the per-worker int64 counter of row
            bytes fetched.
          after: ops the reads must follow (the step's fetch).
          active: None, or a bool scalar: False fetches nothing (a replica
            waiting for the warm start).
        """
        return [
            RowReader(self, j, kh, bytes_fetched, after, active)
            for j in range(len(self.variables))
        ]

    def gradients(self, readers: list[RowReader], row_grads: list) -> list:
        """Each reader's gradient from the tape's gradients of its reads."""
        grads = []
        for reader in readers:
            grads.append(reader.gradient(row_grads[: len(reader.reads)]))
            row_grads = row_grads[len(reader.reads) :]
        return grads

    @staticmethod
    def bytes_fetched(readers: list[RowReader]) -> tf.Tensor:
        """Row bytes `readers` fetched in one step, an int64 scalar."""
        counts = [n for reader in readers for n in reader.bytes_fetched]
        return tf.add_n(counts) if counts else tf.constant(0, tf.int64)

    def to_ps(self, grads: list, pack: bool = False) -> list[tf.IndexedSlices]:
        """`grads` (worker `IndexedSlices`) on each variable's ps task.

        Each moves as it is (values and int64 indices); `pack` is ignored.
        """
        del pack  # Rows differ per step: nothing to pack.
        out = []
        for g, v in zip(grads, self.variables):
            with tf.device(v.device):
                out.append(
                    tf.nest.map_structure(tf.identity, g, expand_composites=True)
                )
        return out

    def bytes_pushed(self, grads: list[tf.IndexedSlices]) -> tf.Tensor:
        """Bytes a push of `grads` sends, an int64 scalar.

        The rows, their squares when they go along, and an 8-byte int64 index
        per row.
        """
        copies = self.plan.push_copies
        sizes = [
            tf.size(g.indices, out_type=tf.int64) * (copies * n + 8)
            for g, n in zip(grads, self.row_bytes)
        ]
        return tf.add_n(sizes) if sizes else tf.constant(0, tf.int64)


class RowReader(substitution.RowSource):
    """What a row-sparse variable reads as during one step's forward pass.

    Each lookup fetches, from the variable's ps task, the rows of its ids not
    fetched since the replica's last fetch, writes them into the replica's
    cache, and returns the rows from the cache, watched by the step's tape.
    Args are as for `RowSparseVariables.readers`, and `j`, the variable.
    """

    def __init__(self, kind, j, kh, bytes_fetched, after, active=None):
        self.kind, self.j, self.kh = kind, j, kh
        self.bytes_handle = bytes_fetched
        self.after, self.active = list(after), active
        self.tape = None  # Set by `Downpour._gradient`.
        self.reads = []  # (flat int64 ids, rows [n, *row_shape]) per lookup.
        self.bytes_fetched = []  # int64 scalars, one per lookup.

    def read_rows(self, indices):
        j, kh = self.j, self.kh
        v = self.kind.variables[j]
        # `tf.nn.embedding_lookup` colocates its gathers with the variable: the
        # cache's ops stay on the worker, only the missing rows' gather on the ps.
        with tf.compat.v1.colocate_with(None, ignore_existing=True):
            ids = tf.cast(tf.reshape(indices, [-1]), tf.int64)
            with tf.control_dependencies(self.after):
                unique, _ = tf.unique(ids)
                missing = tf.equal(base.gather(kh.valid[j], unique, tf.int32), 0)
                if self.active is not None:
                    missing &= self.active
                missing = tf.boolean_mask(unique, missing)
                with tf.device(v.device):
                    rows = base.gather(kh.ps[j], missing, v.dtype)
                nbytes = tf.size(missing, out_type=tf.int64) * self.kind.row_bytes[j]
                ones = tf.ones_like(missing, tf.int32)
                ops = [
                    base.scatter("Update", kh.caches[j], missing, rows),
                    base.scatter("Update", kh.valid[j], missing, ones),
                    base.add(self.bytes_handle, nbytes),
                ]
            with tf.control_dependencies(ops):
                out = base.gather(kh.caches[j], ids, v.dtype)
            self.after = [out]
            self.tape.watch(out)
            self.reads.append((ids, out))
            self.bytes_fetched.append(nbytes)
            shape = tf.concat([tf.shape(indices), v.shape[1:].as_list()], 0)
            return tf.reshape(out, shape)

    def whole_read_error(self, variable) -> RowSparseReadError:
        return RowSparseReadError(
            f"Variable {variable.name} is row-sparse under Downpour (only the rows "
            "a step looks up are fetched and pushed), but the model read it "
            "whole (e.g. a tied output layer, a regularizer, `tf.matmul`). "
            "Leave it out of `row_sparse` (e.g. `row_sparse=[]`)."
        )

    def gradient(self, row_grads: list) -> tf.IndexedSlices:
        """The step's gradient as `IndexedSlices` with unique int64 indices.

        Args:
          row_grads: the tape's gradients of `reads`' rows, in order.
        """
        v = self.kind.variables[self.j]
        row_shape = v.shape[1:].as_list()
        if not self.reads:
            ids = tf.zeros([0], tf.int64)
            grads = tf.zeros([0, *row_shape], v.dtype)
        else:
            ids = tf.concat([ids for ids, _ in self.reads], 0)
            grads = tf.concat([tf.reshape(g, [-1, *row_shape]) for g in row_grads], 0)
        unique, position = tf.unique(ids)
        summed = tf.math.unsorted_segment_sum(grads, position, tf.size(unique))
        return tf.IndexedSlices(
            summed, unique, tf.constant(v.shape.as_list(), tf.int64)
        )
