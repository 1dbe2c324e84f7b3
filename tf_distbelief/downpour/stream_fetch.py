"""Update-stream fetches in TensorFlow: the ps logs pushes, replicas replay them.

The cluster side of `update_stream.simulate(residual="parameter",
fetch="stream")`, used when the outer rule (`push_rules.outer_nesterov`) and
a compressing rule (`push_rules.top_k`, `push_rules.quantize`) are both on
and sparse fetches are off (`is_on`; `push_rules.sparse_fetches`, which
needs `outer_momentum` 0, keeps error feedback and changed-entry fetches).
Every replica then holds what the ps holds by applying the same decoded
compressed pushes through the same Nesterov update, so a fetch moves the
pushes applied since the replica's last fetch instead of the model, and the
outer momentum is kept.

On the ps, next to each dense shard: a sequence number (int64, the pushes
the shard has logged) and a ring of the last `capacity` pushes' encoded parts
(`compression.CompressedPush`'s positions, codes and scales: a fixed size per
push), one variable per part of shape `[capacity, *part]`. The ps function
that applies a push with the outer rule writes its parts at slot `seq %
capacity` after the update, then increments `seq` (`append`), so a log entry
is read only once it is whole.

On each replica, per dense variable (`per_worker_variable=True`): the mirror
`w'` of the ps values, the mirror `m'` of the outer momentum, and the
sequence number its mirror accounts for (-1: no mirror). A fetch
(`fetch_into_cache`) of variable `j` reads the shard's `seq`; when the
replica has a mirror and is at most `window` pushes behind it gathers the
logged parts of those pushes on the ps, sends them, and replays each through
`ResourceApplyKerasMomentum` (the ps's own kernel, so the mirror equals the
ps bit for bit); otherwise (a new replica, a restored one, one behind the
window, or a ps whose log restarted) it sends the shard's values and
momentum (a whole fetch). Then the cache moves by what the mirror moved,
`cache <- cache + (w' - w'_before)`, keeping the replica's unsent progress
(CocktailSGD's local and global copies); after a whole fetch into a replica
without a mirror the cache becomes the mirror.

A push (`exchange.Exchange.push`) then sends `C(w' - cache)` and an applied
push adds the decoded `C(...)` to the cache: what it sent comes back through
the stream, what it did not send stays in the cache (the parameter-space
residual). A push refused for a NaN or inf drops the mirror, so that the
refetch it triggers resets the cache to the ps values.

The ps values and momentum stay the source of truth: the log and the mirrors
are not checkpointed. A replica restored from a checkpoint has no mirror and
fetches whole; after the ps values are restored in a process
(`Downpour.after_restore`) each shard's `seq` jumps past every replica's,
which then fetch whole (`restart_log`).

Ordering: a push's update and log write run in the push's branch; with the
`exactly_once` tokens in scope pushes run one at a time under its lock, so
the log order is the order of the updates. Without them two replicas'
pushes to one shard can interleave, and a whole fetch racing a push can read
the values and momentum on either side of it: the mirror is then off by that
push until the replica's next whole fetch. The ring holds `window +
num_workers` pushes, so that pushes landing while a stream fetch reads (at
most one in flight per other replica) never overwrite an entry it reads.

Bytes of a fetch, per variable: its `seq` (8), plus the logged parts of each
push replayed, or its values and (with `outer_momentum` > 0) momentum when
whole; counted per replica (`bytes_counter`).
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tf_distbelief.downpour import base

__all__ = ["STREAM_WINDOW", "StreamFetch", "StreamHandles", "create", "is_on"]

# Pushes a replica may be behind a shard's log and still replay them: with
# `n_fetch == n_push` a replica is about one push per other replica behind.
STREAM_WINDOW = 64
# Bytes of a shard's sequence number read by each fetch.
_SEQ_BYTES = 8


def is_on(config) -> bool:
    """True when `config` fetches the update stream: the outer rule and a
    compressing rule on, sparse fetches off."""
    rules = config.rules
    outer = any(r.replaces_optimizer and r.pushes_deltas for r in rules)
    sparse = any(r.marks_changes for r in rules)
    return outer and not sparse and any(r.compresses for r in rules)


def create(config, variables: list, strategy, rules, compression):
    """The `StreamFetch` of a replica's dense variables, or None when off.

    Args:
      config: the `DownpourConfig`.
      variables: the dense variables (shards); under the strategy's scope.
      strategy: the `DistBeliefStrategy` (`num_workers`, colocation).
      rules: the `push_rules.on_ps.PushRules` (the outer momentum slots).
      compression: the `push_rules.compression.CompressedPush`.
    """
    if not is_on(config):
        return None
    outer = next(r for r in config.rules if r.replaces_optimizer)
    return StreamFetch(
        variables, strategy, rules.momentums, compression, outer, STREAM_WINDOW
    )


class StreamHandles(NamedTuple):
    """Per-worker handles of one scheduled function (take them at its top)."""

    mirrors: list  # `w'` per variable.
    momentums: list  # `m'` per variable.
    seen: tf.Tensor  # int64 `[variables]`: the `seq` each mirror accounts for.
    nbytes: tf.Tensor  # Bytes the replica's fetches moved.


class StreamFetch:
    """The logs on the ps and the mirrors on the workers (module docstring).

    Create it under the strategy's scope.

    Args:
      variables: the dense `DownpourVariable` shards, in the kind's order.
      strategy: the `DistBeliefStrategy`.
      momentums: the outer momentum slot of each variable, on its ps.
      compression: the `CompressedPush` (the parts' shapes, their decoding).
      outer: the outer rule (`learning_rate`, `momentum`).
      window: pushes a replica may be behind and still replay.

    Attributes:
      seqs: per variable, its int64 sequence number on its ps.
      logs: per variable, one `[capacity, *part]` variable per encoded part.
      capacity: the ring's entries, `window + num_workers`.
      part_nbytes: per variable, bytes of one push's encoded parts.
    """

    def __init__(self, variables, strategy, momentums, compression, outer, window):
        self.variables = list(variables)
        self.momentums = list(momentums)
        self.compression = compression
        self.learning_rate = float(outer.learning_rate)
        self.momentum = float(outer.momentum)
        self.window = int(window)
        self.capacity = self.window + int(strategy.num_workers)
        self.seqs, self.logs, self.part_specs, self.part_nbytes = [], [], [], []
        for v in self.variables:
            specs = compression.part_specs(v)
            self.part_specs.append(specs)
            self.part_nbytes.append(sum(s.num_elements() * d.size for s, d in specs))
            name = base.slug(v.name)
            with strategy.extended.colocate_vars_with(v):
                self.seqs.append(
                    tf.Variable(
                        tf.constant(0, tf.int64),
                        trainable=False,
                        name=f"downpour/stream_seq/{name}",
                    )
                )
                self.logs.append(
                    [
                        tf.Variable(
                            tf.zeros([self.capacity, *shape], dtype),
                            trainable=False,
                            name=f"downpour/stream_log/{name}/{k}",
                        )
                        for k, (shape, dtype) in enumerate(specs)
                    ]
                )
        self.mirrors = base.per_worker_copies(self.variables, "stream_mirror")
        self.mirror_momentums = base.per_worker_copies(
            self.variables, "stream_momentum"
        )
        self._seen = base.per_worker(
            "downpour/stream_seen", [len(self.variables)], tf.int64, fill=-1
        )
        self._nbytes = base.per_worker("downpour/stream_bytes_fetched", [], tf.int64)

    def handles(self) -> StreamHandles:
        """The per-worker handles; take them at the top of the scheduled function."""
        return StreamHandles(
            mirrors=[m.handle for m in self.mirrors],
            momentums=[m.handle for m in self.mirror_momentums],
            seen=self._seen.handle,
            nbytes=self._nbytes.handle,
        )

    def worker_variables(self) -> dict[str, tf.Variable]:
        """The bytes counter (`replica_state` checkpoints it), by key; the
        mirrors are not kept: a restored replica fetches whole first."""
        return {"stats/stream_bytes_fetched": self._nbytes}

    @property
    def bytes_counter(self) -> tf.Variable:
        """The per-worker count of bytes fetched (int64)."""
        return self._nbytes

    def restart_log(self) -> None:
        """Moves each shard's `seq` past every replica's mirror: their next
        fetches are whole. Call it after the ps values were restored from a
        checkpoint in this process."""
        for seq in self.seqs:
            seq.assign_add(self.capacity + 1)

    def drop_mirrors(self, sh: StreamHandles) -> list:
        """Ops making the running replica's next fetch whole, its cache reset
        to the ps values (a refused push)."""
        n = len(self.variables)
        return [base.assign(sh.seen, tf.fill([n], tf.constant(-1, tf.int64)))]

    def unsent(self, kh: base.KindHandles, sh: StreamHandles) -> list:
        """What a push compresses: `w' - cache` per variable, on the worker."""
        return [
            base.read(m, v.dtype) - base.read(c, v.dtype)
            for m, c, v in zip(sh.mirrors, kh.caches, self.variables)
        ]

    def keep_sent(self, kh: base.KindHandles, sent: list) -> list:
        """Ops of an applied push: the decoded `sent` added to each cache."""
        return [base.add(c, s) for c, s in zip(kh.caches, sent)]

    def append(self, parts_on_ps: list, updates: list) -> list:
        """Ops logging one applied push, per variable after its update.

        Args:
          parts_on_ps: per variable, the push's encoded parts on its ps task.
          updates: per variable, the op that applied the push to it.

        Returns:
          The ops, on the variables' ps tasks.
        """
        ops = []
        for j, (parts, update) in enumerate(zip(parts_on_ps, updates)):
            v = self.variables[j]
            with tf.device(v.device):
                seq = self.seqs[j].handle
                with tf.control_dependencies([update]):
                    slot = base.read(seq, tf.int64) % self.capacity
                    writes = [
                        base.scatter(
                            "Update", log.handle, tf.reshape(slot, [1]), part[None]
                        )
                        for log, part in zip(self.logs[j], parts)
                    ]
                with tf.control_dependencies(writes):
                    ops.append(base.add(seq, tf.constant(1, tf.int64)))
        return ops

    def fetch_into_cache(self, kh: base.KindHandles, sh: StreamHandles) -> list:
        """Ops of a fetch into the caches (inside the fetch's `tf.cond` branch).

        Returns:
          The ops; the caches hold the fetch once they have run.
        """
        ops = []
        seen_all = base.read(sh.seen, tf.int64)
        new_seen = []
        for j, v in enumerate(self.variables):
            last = seen_all[j]
            with tf.device(v.device):
                seq = base.read(self.seqs[j].handle, tf.int64)
                behind = seq - last
                whole = (last < 0) | (behind < 0) | (behind > self.window)
            before = base.read(sh.mirrors[j], v.dtype)

            def whole_fetch(j=j, v=v, seq=seq):
                return self._whole(j, v, sh, seq)

            def stream_fetch(j=j, v=v, last=last, behind=behind):
                return self._replay(j, v, sh, last, behind)

            nbytes = tf.cond(whole, whole_fetch, stream_fetch)
            with tf.control_dependencies([nbytes]):
                after = base.read(sh.mirrors[j], v.dtype)
                cache = base.read(kh.caches[j], v.dtype)
                moved = tf.where(last < 0, after, cache + (after - before))
                ops.append(base.assign(kh.caches[j], moved))
                ops.append(base.add(sh.nbytes, nbytes + _SEQ_BYTES))
            new_seen.append(seq)
        with tf.control_dependencies(ops):
            ops.append(base.assign(sh.seen, tf.stack(new_seen)))
        return ops

    def _whole(self, j, v, sh, seq) -> tf.Tensor:
        """The shard's values, and its momentum once a push has moved it (and
        `outer_momentum` > 0), into the mirrors; returns bytes."""
        nbytes = v.shape.num_elements() * v.dtype.size
        with tf.device(v.device):
            value = base.read(base.ps_handle(v), v.dtype)
            sends_momentum = (seq > 0) & tf.constant(self.momentum > 0)

            def momentum():
                return base.read(self.momentums[j].handle, v.dtype)

            def zeros():
                return tf.zeros(v.shape, v.dtype)

            moment = tf.cond(sends_momentum, momentum, zeros)
        ops = [
            base.assign(sh.mirrors[j], value),
            base.assign(sh.momentums[j], moment),
        ]
        count = tf.where(sends_momentum, 2 * nbytes, nbytes)
        return base.after(ops, tf.cast(count, tf.int64))

    def _replay(self, j, v, sh, last, behind) -> tf.Tensor:
        """The logged pushes since `last` replayed into the mirrors; returns
        bytes."""
        with tf.device(v.device):
            slots = (last + tf.range(behind, dtype=tf.int64)) % self.capacity
            gathered = [
                base.gather(log.handle, slots, dtype)
                for log, (_, dtype) in zip(self.logs[j], self.part_specs[j])
            ]
        # Cast as `OuterNesterov.update` casts them on the ps (through
        # float32), so that the replay is the ps's update bit for bit.
        lr = tf.cast(self.learning_rate, v.dtype)
        mu = tf.cast(self.momentum, v.dtype)

        def body(i):
            parts = tuple(g[i] for g in gathered)
            for g, (shape, _) in zip(parts, self.part_specs[j]):
                g.set_shape(shape)
            delta = self.compression.decode(parts, v)
            update = tf.raw_ops.ResourceApplyKerasMomentum(
                var=sh.mirrors[j],
                accum=sh.momentums[j],
                lr=lr,
                grad=delta,
                momentum=mu,
                use_locking=False,
                use_nesterov=True,
            )
            return base.after([update], i + 1)

        done = tf.while_loop(lambda i: i < behind, body, [tf.constant(0, tf.int64)])
        return base.after([done], behind * self.part_nbytes[j])
