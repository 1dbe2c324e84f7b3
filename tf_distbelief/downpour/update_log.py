"""The ps side of update-stream fetches: each ps task's log of compressed pushes.

`stream_fetch` keeps every replica's mirror of the ps by replaying the
compressed pushes the ps applied; this module is what it replays from. Per
group of dense variables a push packs together (those of one ps task and
dtype, `dense.DenseVariables.groups`), the group's ps task holds a sequence
number `seq` (int64, pushes logged) and a ring of the last `capacity`
pushes (`UpdateLog.append`): each one's encoded parts
(`compression.CompressedPush`'s, a fixed size per push; one variable per
part, `[capacity, size]`, the group's variables' parts concatenated as the
push carried them), its replica, its staleness when a push rule on the ps
reads it (`stale_damping`, `staleness_scaled`: a replica replays the push
through them), and the group's `checksum` after it,
written at slot `seq % capacity` after the update and before `seq` moves:
an entry below `seq` is whole. One log per ps task, not per variable, so
that a push and a fetch make a few transfers and ops per ps task whatever
the number of variables on it.

Each push and its log entries, and a whole fetch's reads, run in one lock
(`UpdateLog.locked`, which says why a stream fetch needs none). The log is
not checkpointed: it starts at a random `origin`, and after the ps values
are restored in the same process `UpdateLog.restart` moves each `seq` and
floor past every mirror, so that a replica's next fetch is whole.

The checksum (`checksum`) is a sum of bit patterns as integers: no
rounding, in any order, on any device, so a replica compares its mirror
with the ps exactly.
"""

from __future__ import annotations

import random

import tensorflow as tf

from tf_distbelief.downpour import base

__all__ = ["UpdateLog", "checksum", "packed"]

# The integer type each float's bits are summed as, by the float's bytes (a
# float64 is two int32s): the int64 sum of fewer than 2**32 such values
# cannot overflow.
_BITS = {2: tf.int16, 4: tf.int32, 8: tf.int32}


def checksum(values) -> tf.Tensor:
    """The int64 sum of the bit patterns of `values` (float tensors).

    Bit-identical values give the same sum on any device and in any order of
    summation (integer addition is exact), so two copies are compared
    exactly; one differing bit changes it.

    Args:
      values: float tensors (16, 32 or 64 bits), each of fewer than 2**31
        entries.

    Returns:
      An int64 scalar.
    """
    total = tf.constant(0, tf.int64)
    for x in values:
        bits = tf.bitcast(x, _BITS[x.dtype.size])
        total += tf.reduce_sum(tf.cast(bits, tf.int64))
    return total


class UpdateLog:
    """The logs of a replica kind's dense variables on their ps tasks.

    Create it under the strategy's scope.

    Args:
      variables: the dense `DownpourVariable` shards, in the kind's order.
      groups: the variables' indices by ps task and dtype, as a push packs
        them (`dense.DenseVariables.groups`): one log per group.
      strategy: the `DistBeliefStrategy`.
      momentums: the outer momentum slot of each variable, on its ps.
      compression: the `CompressedPush` (the parts' shapes).
      momentum: the outer momentum `mu`: with 0 the checksum leaves the
        momentum out (it does not reach the values).
      capacity: the ring's entries.
      tokens: the optimizer's `exactly_once.StepTokens` (its critical
        section: `locked`).
      logs_staleness: keep each push's staleness (a push rule on the ps
        reads it).

    Attributes:
      groups: per group, the indices of its variables.
      seqs: per group, its int64 sequence number on its ps.
      logs: per group, one `[capacity, size]` variable per encoded part,
        its variables' parts of a push concatenated in group order.
      pushers: per group, the int64 `[capacity]` replica of each logged push.
      stalenesses: per group, the int64 `[capacity]` staleness of each
        logged push; empty unless `logs_staleness`.
      sums: per group, the int64 `[capacity]` `checksum` of the group's
        variables (and momentums) after each logged push.
      floors: per group, the int64 `seq` of its last restart: a mirror older
        than it fetches whole.
      origin: the sequence numbers' start.
      capacity: the ring's entries.
      part_specs: per group, `(size, dtype)` of each packed part.
      part_nbytes: per group, bytes of one push's encoded parts.
    """

    def __init__(
        self, variables, groups, strategy, momentums, compression, momentum,
        capacity, tokens, logs_staleness=False,
    ):  # fmt: skip
        self.variables = list(variables)
        self.groups = [list(g) for g in groups]
        self.momentums = list(momentums)
        self.momentum = float(momentum)
        self.capacity = int(capacity)
        self.seqs, self.logs, self.part_specs, self.part_nbytes = [], [], [], []
        self.pushers, self.floors, self.sums = [], [], []
        self.stalenesses = []
        self.logs_staleness = bool(logs_staleness)
        # Per group, per part: each variable's length of it (1-D parts).
        self._piece_sizes = []
        self._section = tokens.section
        self._section_device = tokens.ring.device
        # A log created anew (a new process) starts far from any restored
        # mirror's sequence number, which then fetches whole.
        self.origin = random.getrandbits(40) << 20

        def ps_variable(initial, name):
            return tf.Variable(initial, trainable=False, name=f"downpour/{name}")

        for group in self.groups:
            per_variable = [compression.part_specs(self.variables[j]) for j in group]
            sizes = [
                [specs[k][0].num_elements() for specs in per_variable]
                for k in range(len(per_variable[0]))
            ]
            specs = [(sum(n), dtype) for n, (_, dtype) in zip(sizes, per_variable[0])]
            self._piece_sizes.append(sizes)
            self.part_specs.append(specs)
            self.part_nbytes.append(sum(n * d.size for n, d in specs))
            first = self.variables[group[0]]
            name = base.slug(first.name)
            origin = tf.constant(self.origin, tf.int64)
            with strategy.extended.colocate_vars_with(first):
                self.seqs.append(ps_variable(origin, f"stream_seq/{name}"))
                self.logs.append(
                    [
                        ps_variable(
                            tf.zeros([self.capacity, n], dtype),
                            f"stream_log/{name}/{k}",
                        )
                        for k, (n, dtype) in enumerate(specs)
                    ]
                )
                self.floors.append(ps_variable(origin, f"stream_floor/{name}"))
                self.pushers.append(
                    ps_variable(
                        tf.fill([self.capacity], tf.constant(-1, tf.int64)),
                        f"stream_pushers/{name}",
                    )
                )
                self.sums.append(
                    ps_variable(
                        tf.zeros([self.capacity], tf.int64), f"stream_sums/{name}"
                    )
                )
                if self.logs_staleness:
                    self.stalenesses.append(
                        ps_variable(
                            tf.zeros([self.capacity], tf.int64),
                            f"stream_staleness/{name}",
                        )
                    )

    def locked(self, fn):
        """`fn()` in the pushes' critical section, on its ps task.

        The lock is taken once every tensor `fn`'s ops read from outside is
        there. `fn` returns tensors on the ps that come after all its
        effects: the lock is released once they are made.

        Each push's update and log entries, and a whole fetch's reads of the
        values, momentum and `seq`, run in the `exactly_once` tokens'
        `tf.CriticalSection` (a push without a token is put in it too): the
        log's order is the updates', and a whole fetch is a snapshot of
        exactly the pushes below its `seq`. A stream fetch takes no lock: the
        ring holds `window + num_workers` pushes, so with one push per
        replica per round none it reads is overwritten meanwhile (the
        checksum would find it if one were).
        """
        with tf.device(self._section_device):
            return self._section.execute(fn)

    def restart(self) -> None:
        """Moves each group's `seq` and floor past every replica's mirror:
        their next fetches are whole. Call it after the ps values were
        restored from a checkpoint in this process."""
        for seq, floor in zip(self.seqs, self.floors):
            floor.assign(seq.assign_add(self.capacity + 1))

    def unpack(self, g: int, packed) -> list:
        """`packed` undone: per variable of the group, its parts (a tuple)."""
        split = [
            tf.split(x, sizes) if len(sizes) > 1 else [x]
            for x, sizes in zip(packed, self._piece_sizes[g])
        ]
        return [tuple(pieces) for pieces in zip(*split)]

    def append(self, parts_on_ps: list, updates: list, worker, staleness=None) -> list:
        """Ops logging one applied push, per group after its variables' updates.

        Run them in the critical section (`locked`) with the updates.

        Args:
          parts_on_ps: per variable, the push's encoded parts on its ps task.
          updates: per variable, the op that applied the push to it.
          worker: the pushing replica's index, an integer scalar tensor.
          staleness: the push's staleness as the rules read it, an int64
            scalar (with `logs_staleness`), or None.

        Returns:
          The ops, on the groups' ps tasks.
        """
        ops = []
        for g, group in enumerate(self.groups):
            with tf.device(self.variables[group[0]].device):
                entry = packed([parts_on_ps[j] for j in group])
                seq = self.seqs[g].handle
                with tf.control_dependencies([updates[j] for j in group]):
                    slot = base.read(seq, tf.int64) % self.capacity
                    at = tf.reshape(slot, [1])
                    writes = [
                        base.scatter("Update", log.handle, at, part[None])
                        for log, part in zip(self.logs[g], entry)
                    ]
                    pusher = tf.reshape(tf.cast(worker, tf.int64), [1])
                    writes.append(
                        base.scatter("Update", self.pushers[g].handle, at, pusher)
                    )
                    if self.logs_staleness:
                        stale = tf.reshape(tf.cast(staleness, tf.int64), [1])
                        writes.append(
                            base.scatter(
                                "Update", self.stalenesses[g].handle, at, stale
                            )
                        )
                    total = checksum(self.ps_state(g))
                    writes.append(
                        base.scatter("Update", self.sums[g].handle, at, total[None])
                    )
                with tf.control_dependencies(writes):
                    ops.append(base.add(seq, tf.constant(1, tf.int64)))
        return ops

    def ps_state(self, g: int) -> list:
        """What a group's checksum covers on the ps: its variables' values,
        and their momentums when `mu` > 0 (with 0 it does not reach the
        values)."""
        state = []
        for j in self.groups[g]:
            v = self.variables[j]
            state.append(base.read(base.ps_handle(v), v.dtype))
            if self.momentum > 0:
                state.append(base.read(self.momentums[j].handle, v.dtype))
        return state


def packed(parts: list) -> list:
    """A group's parts of one push, one tensor per part: its variables'
    pieces (`parts`, per variable in group order) concatenated."""
    return [
        tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0] for pieces in zip(*parts)
    ]
