"""Sparse fetches in TensorFlow: the ps flags changed entries, a fetch sends them.

`push_rules.sparse_fetches` is the setting and its rules; this module is its
state and ops. Next to each dense shard the ps keeps a `[num_workers,
entries]` bool variable of flags (all set at the start, not checkpointed: a
new or restored ps sets them all again). Each replica keeps, per group of
variables moved together (`DenseVariables.groups`: one ps task and dtype), a
flat mirror of what it last fetched, and a flag saying whether the mirror
holds a whole fetch (`per_worker_variable=True`, not checkpointed: a new or
restored replica starts without one).

* An applied push flags, for every replica, each entry it sent a non-zero
  value for, after the ps optimizer (or push rule) applied it (`mark`).
* A fetch (`fetch_into_cache`) of a replica whose mirror is whole reads its
  row of flags on each ps task, clears the flagged entries, then reads their
  values, and sends int32 positions (within the group) and values, one
  tensor each per group; the replica scatters them into its mirror and
  copies the mirror into its caches. Otherwise it clears its row, sends the
  whole group packed (as `DenseVariables.pull`) and keeps it as the mirror.

The bytes a replica's fetches moved are a per-worker counter, checkpointed
with its other counters (`worker_variables`).
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tf_distbelief.downpour import base, dense
from tf_distbelief.downpour.push_rules import rule as push_rule

__all__ = ["SparseFetch", "SparseHandles", "create"]


def create(config, variables: list, groups: list[list[int]], strategy, optimizer):
    """The `SparseFetch` of a replica's dense variables, or None when off.

    Args:
      config: the `DownpourConfig`.
      variables: the dense variables (shards); under the strategy's scope.
      groups: their indices by ps task and dtype (`DenseVariables.groups`).
      strategy: the `DistBeliefStrategy` (`num_workers`).
      optimizer: the ps optimizer (`check_optimizer`).

    Raises:
      ValueError: the ps optimizer changes entries a push sent nothing for
        (`check_optimizer`), or a group is too large for int32 positions.
    """
    if not any(r.marks_changes for r in config.rules):
        return None
    check_optimizer(config, optimizer)
    return SparseFetch(variables, groups, strategy)


def check_optimizer(config, optimizer) -> None:
    """Raises unless the ps update leaves every entry pushed as 0 unchanged.

    The flags mark only the entries a push sent a non-zero value for: AdaGrad
    (tf_keras's or `tf_distbelief.adagrad`'s) and SGD without momentum
    change no other, and neither does a push rule that replaces the ps
    optimizer here (the outer optimizer, which `sparse_fetches` takes without
    momentum). Momentum, Adam's moments and weight decay move every entry.

    Raises:
      ValueError: naming the optimizer and what is allowed.
    """
    import tf_keras

    if any(r.replaces_optimizer for r in config.rules):
        return
    sgd = isinstance(optimizer, tf_keras.optimizers.SGD)
    ok = isinstance(optimizer, tf_keras.optimizers.Adagrad) or (
        sgd and float(optimizer.momentum) == 0.0
    )
    if ok and not getattr(optimizer, "weight_decay", None):
        return
    raise ValueError(
        "Argument `sparse_fetches` needs a ps optimizer that changes only the "
        "entries a push sends: AdaGrad, or SGD without momentum, without "
        "weight decay (or the outer optimizer, `outer_learning_rate`). "
        f"Received: {type(optimizer).__name__}"
        + (f" with momentum={optimizer.momentum!r}" if sgd else "")
        + (
            f", weight_decay={optimizer.weight_decay!r}"
            if getattr(optimizer, "weight_decay", None)
            else ""
        )
    )


class SparseHandles(NamedTuple):
    """Per-worker handles of one scheduled function (take them at its top)."""

    mirrors: list  # One flat mirror per group.
    whole: tf.Tensor  # 1 once the mirrors hold a whole fetch.
    nbytes: tf.Tensor  # Bytes the replica's fetches moved.


def _task(device: str) -> tuple:
    """`(job, task)` of a device string."""
    spec = tf.DeviceSpec.from_string(device or "")
    return spec.job, spec.task


class SparseFetch:
    """The flags on the ps and the mirrors on the workers (module docstring).

    Create it under the strategy's scope.

    Args:
      variables: the dense `DownpourVariable` shards, in the kind's order.
      groups: their indices by ps task and dtype (`DenseVariables.groups`).
      strategy: the `DistBeliefStrategy`: its `num_workers` (rows of the
        flags) and `colocate_vars_with`.

    Attributes:
      flags: per variable, its `[num_workers, entries]` bool flags on its ps.
      mirrors: per group, the per-worker flat mirror.
      model_nbytes: bytes of a whole fetch.
    """

    def __init__(self, variables: list, groups: list[list[int]], strategy):
        self.variables = list(variables)
        self.groups = [list(g) for g in groups]
        self.num_workers = int(strategy.num_workers)
        self.flags = []
        for v in self.variables:
            with strategy.extended.colocate_vars_with(v):
                self.flags.append(
                    tf.Variable(
                        tf.ones([self.num_workers, v.shape.num_elements()], tf.bool),
                        trainable=False,
                        name=f"downpour/changed/{base.slug(v.name)}",
                    )
                )
        self.mirrors = []
        for g, group in enumerate(self.groups):
            size = sum(self.variables[j].shape.num_elements() for j in group)
            if size >= 2**31:
                names = ", ".join(self.variables[j].name for j in group)
                raise ValueError(
                    "Argument `sparse_fetches` sends int32 positions: the "
                    "variables of one ps task and dtype must hold fewer than "
                    f"2**31 entries. Received: {size} in {names}"
                )
            dtype = self.variables[group[0]].dtype
            self.mirrors.append(base.per_worker(f"downpour/mirror/{g}", [size], dtype))
        self._whole = base.per_worker("downpour/mirror_whole", [], tf.int64)
        self._nbytes = base.per_worker("downpour/sparse_bytes_fetched", [], tf.int64)
        self.model_nbytes = sum(
            v.shape.num_elements() * v.dtype.size for v in self.variables
        )

    def flag_all(self) -> None:
        """Sets every flag: each replica's next fetch sends every entry.

        Call it after the ps values were restored from a checkpoint in this
        process (`replica_state.ReplicaState.write_back`): the replicas'
        mirrors hold values from before.
        """
        for flags in self.flags:
            flags.assign(tf.ones(flags.shape, tf.bool))

    def handles(self) -> SparseHandles:
        """The per-worker handles; take them at the top of the scheduled function."""
        return SparseHandles(
            mirrors=[m.handle for m in self.mirrors],
            whole=self._whole.handle,
            nbytes=self._nbytes.handle,
        )

    def worker_variables(self) -> dict[str, tf.Variable]:
        """The bytes counter (`replica_state` checkpoints it), by key; the
        mirrors are not kept: a restored replica fetches whole first."""
        return {"stats/sparse_bytes_fetched": self._nbytes}

    @property
    def bytes_counter(self) -> tf.Variable:
        """The per-worker count of bytes fetched (int64)."""
        return self._nbytes

    def _offsets(self, group: list[int]) -> list[int]:
        sizes = [self.variables[j].shape.num_elements() for j in group]
        return [sum(sizes[:i]) for i in range(len(group))]

    def fetch_into_cache(self, kh: base.KindHandles, sh: SparseHandles, worker):
        """Ops of a fetch into the caches (inside the fetch's `tf.cond` branch).

        Args:
          kh: the dense kind's handles (its `ps` and `caches`).
          sh: this module's handles.
          worker: the running worker's index, an integer scalar tensor.

        Returns:
          `[done]`: a bool tensor, True once the caches hold the fetch.
        """
        row = tf.cast(worker, tf.int64)

        def changed():
            return base.after(self._changed(kh, sh, row), True)

        def whole():
            return base.after(self._whole_fetch(kh, sh, row), True)

        return [tf.cond(base.read(sh.whole, tf.int64) > 0, changed, whole)]

    def _whole_fetch(self, kh, sh, row) -> list:
        ops = []
        for g, group in enumerate(self.groups):
            values = []
            with tf.device(self.variables[group[0]].device):
                for j in group:
                    v = self.variables[j]
                    zeros = tf.zeros([1, v.shape.num_elements()], tf.bool)
                    clear = base.scatter(
                        "Update",
                        base.ps_handle(self.flags[j]),
                        tf.reshape(row, [1]),
                        zeros,
                    )
                    with tf.control_dependencies([clear]):
                        values.append(base.read(kh.ps[j], v.dtype))
                packed = dense.pack_flat(values)
            ops.append(base.assign(sh.mirrors[g], packed))
        with tf.control_dependencies(ops):
            ops = ops + self._mirrors_into_caches(kh, sh)
            ops.append(base.assign(sh.whole, tf.constant(1, tf.int64)))
            ops.append(base.add(sh.nbytes, tf.constant(self.model_nbytes, tf.int64)))
        return ops

    def _changed(self, kh, sh, row) -> list:
        # The mirrors are not whole while flags are cleared and their values
        # not yet written: a fetch cut off in between makes the next whole.
        unsure = base.assign(sh.whole, tf.constant(0, tf.int64))
        ops, nbytes = [], []
        for g, group in enumerate(self.groups):
            positions, values = [], []
            dtype = self.variables[group[0]].dtype
            with tf.device(self.variables[group[0]].device):
                for j, offset in zip(group, self._offsets(group)):
                    v = self.variables[j]
                    flagged = base.gather(
                        base.ps_handle(self.flags[j]), tf.reshape(row, [1]), tf.bool
                    )[0]
                    where = tf.where(flagged)[:, 0]
                    at = tf.stack([tf.fill(tf.shape(where), row), where], 1)
                    with tf.control_dependencies([unsure]):
                        clear = tf.raw_ops.ResourceScatterNdUpdate(
                            ref=base.ps_handle(self.flags[j]),
                            indices=at,
                            updates=tf.zeros(tf.shape(where), tf.bool),
                        )
                    # The values after the flags are cleared: a push landing
                    # in between flags its entries again for the next fetch.
                    with tf.control_dependencies([clear]):
                        value = base.read(kh.ps[j], v.dtype)
                    values.append(tf.gather(tf.reshape(value, [-1]), where))
                    positions.append(tf.cast(where, tf.int32) + offset)
                positions = tf.concat(positions, 0) if len(group) > 1 else positions[0]
                values = tf.concat(values, 0) if len(group) > 1 else values[0]
            ops.append(base.scatter("Update", sh.mirrors[g], positions, values))
            entry = push_rule.POSITION_BYTES + dtype.size
            nbytes.append(tf.size(positions, out_type=tf.int64) * entry)
        with tf.control_dependencies(ops):
            ops = ops + self._mirrors_into_caches(kh, sh)
            ops.append(base.add(sh.nbytes, tf.add_n(nbytes)))
        with tf.control_dependencies(ops):
            ops.append(base.assign(sh.whole, tf.constant(1, tf.int64)))
        return ops

    def _mirrors_into_caches(self, kh, sh) -> list:
        ops = []
        for g, group in enumerate(self.groups):
            mirror = base.read(sh.mirrors[g], self.variables[group[0]].dtype)
            shapes = [self.variables[j].shape for j in group]
            for j, part in zip(group, dense.unpack_flat(mirror, shapes)):
                ops.append(base.assign(kh.caches[j], part))
        return ops

    def mark(self, grads: list, applied: list) -> list:
        """Ops flagging, for every replica, the entries an applied push changed.

        Args:
          grads: the applied push per variable, tensors on the variables' ps
            tasks (decoded: 0 where nothing was sent).
          applied: the ops that applied it; each variable's flags are set
          after the stateful ones of them on its ps task (all stateful ones
          if none is), and after a read of the variable, which TensorFlow's
          automatic control dependencies order after every update of it
          traced before. Stateless ops are left out: among them are the
          branch's captured inputs (`Placeholder` ops), and a control edge
          from one hung every step when the push's `tf.cond` ran whole on a
          single ps task (`exactly_once.gate` with one ps).

        Returns:
          The ops, one per variable, on its ps task.
        """
        ops = []
        applied = [op for op in applied if op.op_def.is_stateful]
        rows = tf.range(self.num_workers, dtype=tf.int64)
        for j, (g, v) in enumerate(zip(grads, self.variables)):
            if not v.shape.num_elements():
                continue  # Nothing to flag.
            with tf.device(v.device):
                where = tf.where(tf.not_equal(tf.reshape(g, [-1]), 0))[:, 0]
                at = tf.reshape(
                    tf.stack(tf.meshgrid(rows, where, indexing="ij"), -1), [-1, 2]
                )
                task = _task(v.device)
                mine = [op for op in applied if _task(op.device) == task]
                zero = tf.zeros([1], tf.int64)
                anchor = base.gather(base.ps_handle(v), zero, v.dtype)
                with tf.control_dependencies((mine or applied) + [anchor]):
                    ops.append(
                        tf.raw_ops.ResourceScatterNdUpdate(
                            ref=base.ps_handle(self.flags[j]),
                            indices=at,
                            updates=tf.ones(tf.shape(at)[:1], tf.bool),
                        )
                    )
        return ops
