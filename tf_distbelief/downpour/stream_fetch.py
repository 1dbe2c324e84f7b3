"""Update-stream fetches in TensorFlow: the ps logs pushes, replicas replay them.

The cluster side of `update_stream.simulate(residual="parameter",
fetch="stream")`, used when the outer rule (`push_rules.outer_nesterov`) and
a compressing rule (`push_rules.top_k`, `push_rules.quantize`) are both on
and sparse fetches are off (`is_on`; `push_rules.sparse_fetches`, which
needs `outer_momentum` 0, keeps error feedback and changed-entry fetches).
Every replica holds what the ps holds by applying the same decoded
compressed pushes through the same Nesterov update, so a fetch moves the
pushes applied since the replica's last fetch, not the model, and the outer
momentum is kept.

On the ps, per ps task and dtype, the log of the pushes it applied
(`update_log.UpdateLog`: a sequence number `seq`, a ring of encoded pushes,
their replicas and checksums).

On each replica, per dense variable (`per_worker_variable=True`): the mirror
`w'` of the ps values and the mirror `m'` of the outer momentum; whether
the mirrors hold a fetch (`mirrored`); per group, the `seq` its mirrors
account for (-1: none in this process). A fetch (`fetch_into_cache`)
reads each group's `seq`; mirrors at most `window` pushes behind replay the
pushes logged since through the push rules' corrections and
`ResourceApplyKerasMomentum` (`push_rules.on_ps.corrected` and the ps's
kernel, with each push's logged staleness and the mirror of the momentum:
bit for bit the ps), after which their checksum must equal the last
entry's, exactly (a sum of bit patterns as integers: no rounding, in any
order, on any device). Otherwise (a new or restored replica, one behind the
window, a ps whose log restarted), or on a checksum mismatch (a resync,
counted: `resync_counter`), it gets the group's values and momentums (a
whole fetch). The cache then moves by what the mirror moved, `cache <- cache
+ (w' - w'_before)`, keeping the replica's unsent progress (CocktailSGD's
local and global copies), or becomes the mirror when there was none.

A push (`exchange.Exchange.push`) sends `C(w' - cache)` and an applied push
adds the decoded `C(...)` to the cache: what it sent comes back through the
stream, what it did not stays in the cache (the parameter-space residual).
A push refused for a NaN or inf drops the mirror: its refetch resets the
cache to the ps values. A replica keeps its own last applied push's parts
(`keep_sent`): when that is the only push a stream fetch replays, only its
index is sent (`n_fetch == n_push`: one per round).

Pushes and whole fetches take the log's lock (`UpdateLog.locked`, which
says why a stream fetch needs none). The ps values and momentum stay the
source of truth; the mirrors and `mirrored` are replica state, the log and
the `seq`s are not checkpointed, so a checkpoint resumes into another
number of ps tasks. A restore of the ps values (`Downpour.after_restore`)
restarts the log (`UpdateLog.restart`): a restored mirror fetches whole and
the cache moves by what it moved, as a replay would (exact resumes).

Bytes of a fetch: each replica counts what its fetches move
(`bytes_counter`); the rule, per group, is in docs/downpour.md
("Update-stream fetches and the parameter-space residual").
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tf_distbelief.downpour import base, update_log, update_stream
from tf_distbelief.downpour.push_rules import on_ps

__all__ = [
    "StreamFetch",
    "StreamHandles",
    "create",
    "is_on",
]

# Bytes of a shard's sequence number read by each fetch, of a logged push's
# replica index, and of the checksum a stream fetch reads.
_SEQ_BYTES = 8
_ID_BYTES = 8
_SUM_BYTES = 8


def is_on(config) -> bool:
    """True when `config` fetches the update stream: the outer rule and a
    compressing rule on, sparse fetches off (the outer rule without sparse
    fetches: `DownpourConfig.has_final_round`)."""
    return config.has_final_round and any(r.compresses for r in config.rules)


def create(config, variables: list, groups, strategy, rules, compression, tokens):
    """The `StreamFetch` of a replica's dense variables, or None when off.

    Args:
      config: the `DownpourConfig`.
      variables: the dense variables (shards); under the strategy's scope.
      groups: their indices by ps task and dtype
        (`dense.DenseVariables.groups`).
      strategy: the `DistBeliefStrategy` (`num_workers`, colocation).
      rules: the `push_rules.on_ps.PushRules` (the outer momentum slots).
      compression: the `push_rules.compression.CompressedPush`.
      tokens: the optimizer's `exactly_once.StepTokens`, whose critical
        section pushes and whole fetches run in.

    A config with update-stream fetches has `n_fetch == n_push` and no rule
    on the ps that a replica cannot replay (`push_rules.rule`,
    `check_compressible`).
    """
    if not is_on(config):
        return None
    outer = next(r for r in config.rules if r.replaces_optimizer)
    return StreamFetch(
        variables,
        groups,
        strategy,
        rules.momentums,
        compression,
        outer,
        update_stream.stream_window(strategy.num_workers),
        tokens,
        rules.rules,
    )


class StreamHandles(NamedTuple):
    """Per-worker handles of one scheduled function (take them at its top)."""

    mirrors: list  # `w'` per variable.
    momentums: list  # `m'` per variable.
    seen: tf.Tensor  # int64 `[groups]`: the `seq` each group's mirrors account for.
    mirrored: tf.Tensor  # int64: 1 once the mirrors hold a fetch, 0 before.
    nbytes: tf.Tensor  # Bytes the replica's fetches moved.
    resyncs: tf.Tensor  # Stream fetches that went whole on a checksum mismatch.
    own: list  # Per group, its packed parts of the replica's last applied push.
    own_pending: tf.Tensor  # 1 while that push has not been replayed.


class StreamFetch:
    """The replicas' mirrors of the ps, kept by replaying its log (module
    docstring).

    Create it under the strategy's scope.

    Args:
      variables: the dense `DownpourVariable` shards, in the kind's order.
      groups: the variables' indices by ps task and dtype, as a push packs
        them (`dense.DenseVariables.groups`): one log per group.
      strategy: the `DistBeliefStrategy`.
      momentums: the outer momentum slot of each variable, on its ps.
      compression: the `CompressedPush` (the parts' shapes, their decoding).
      outer: the outer rule (`learning_rate`, `momentum`).
      window: pushes a replica may be behind and still replay.
      tokens: the optimizer's `exactly_once.StepTokens` (its critical
        section: `update_log.UpdateLog.locked`).
      rules: the push rules in effect, which a replay applies as the ps
        does (`push_rules.on_ps.corrected`).

    Attributes:
      groups: per group, the indices of its variables.
      log: the `update_log.UpdateLog` on the ps tasks.
    """

    def __init__(
        self,
        variables,
        groups,
        strategy,
        momentums,
        compression,
        outer,
        window,
        tokens,
        rules=(),
    ):
        self.variables = list(variables)
        self.rules = tuple(rules)
        self.groups = [list(g) for g in groups]
        self.momentums = list(momentums)
        self.compression = compression
        self.learning_rate = float(outer.learning_rate)
        self.momentum = float(outer.momentum)
        self.window = int(window)
        self.log = update_log.UpdateLog(
            self.variables,
            self.groups,
            strategy,
            self.momentums,
            compression,
            self.momentum,
            self.window + int(strategy.num_workers),
            tokens,
            logs_staleness=any(r.needs_staleness for r in self.rules),
        )
        self.mirrors = base.per_worker_copies(self.variables, "stream_mirror")
        self.mirror_momentums = base.per_worker_copies(
            self.variables, "stream_momentum"
        )
        # Not replica state: after a restore the log is another (a new
        # process) or restarted (`UpdateLog.restart`), so each group's first fetch
        # is whole whatever `seen` says; what is kept is whether the mirrors
        # hold a fetch (`_mirrored`), which decides whether that fetch keeps
        # the cache's unsent progress. So a checkpoint resumes into any
        # number of ps tasks (of groups).
        self._seen = base.per_worker(
            "downpour/stream_seen", [len(self.groups)], tf.int64, fill=-1
        )
        self._mirrored = base.per_worker("downpour/stream_mirrored", [], tf.int64)
        self._nbytes = base.per_worker("downpour/stream_bytes_fetched", [], tf.int64)
        self._resyncs = base.per_worker("downpour/stream_resyncs", [], tf.int64)
        self.own = [
            [
                base.per_worker(
                    f"downpour/stream_own/{base.slug(self.variables[group[0]].name)}"
                    f"/{k}",
                    [n],
                    dtype,
                )
                for k, (n, dtype) in enumerate(specs)
            ]
            for group, specs in zip(self.groups, self.log.part_specs)
        ]
        self._own_pending = base.per_worker("downpour/stream_own_pending", [], tf.int64)

    def handles(self) -> StreamHandles:
        """The per-worker handles; take them at the top of the scheduled function."""
        return StreamHandles(
            mirrors=[m.handle for m in self.mirrors],
            momentums=[m.handle for m in self.mirror_momentums],
            seen=self._seen.handle,
            mirrored=self._mirrored.handle,
            nbytes=self._nbytes.handle,
            resyncs=self._resyncs.handle,
            own=[[x.handle for x in parts] for parts in self.own],
            own_pending=self._own_pending.handle,
        )

    def worker_variables(self) -> dict[str, tf.Variable]:
        """The counters, the mirrors and whether they hold a fetch
        (`replica_state` checkpoints them), by key."""
        named = {
            "stats/stream_bytes_fetched": self._nbytes,
            "stats/stream_resyncs": self._resyncs,
            "stream/mirrored": self._mirrored,
        }
        for j, (m, u) in enumerate(zip(self.mirrors, self.mirror_momentums)):
            named[f"stream/mirror/{j}"] = m
            named[f"stream/momentum/{j}"] = u
        return named

    @property
    def bytes_counter(self) -> tf.Variable:
        """The per-worker count of bytes fetched (int64)."""
        return self._nbytes

    @property
    def mirrored_flag(self) -> tf.Variable:
        """The per-worker int64 flag: 1 once the mirrors hold a fetch (0: the
        next fetch is whole and the cache becomes the ps values)."""
        return self._mirrored

    @property
    def resync_counter(self) -> tf.Variable:
        """The per-worker count of stream fetches that went whole on a
        checksum mismatch (int64)."""
        return self._resyncs

    def drop_mirrors(self, sh: StreamHandles) -> list:
        """Ops making the running replica's next fetch whole, its cache reset
        to the ps values (a refused push)."""
        n = len(self.groups)
        return [
            base.assign(sh.seen, tf.fill([n], tf.constant(-1, tf.int64))),
            base.assign(sh.mirrored, tf.constant(0, tf.int64)),
        ]

    def unsent(self, kh: base.KindHandles, sh: StreamHandles) -> list:
        """What a push compresses: `w' - cache` per variable, on the worker."""
        return [
            base.read(m, v.dtype) - base.read(c, v.dtype)
            for m, c, v in zip(sh.mirrors, kh.caches, self.variables)
        ]

    def keep_sent(
        self, kh: base.KindHandles, sh: StreamHandles, sent: list, parts: list
    ) -> list:
        """Ops of an applied push: the decoded `sent` added to each cache, and
        its encoded `parts` (per variable) kept, packed by group, as the
        replica's own last push."""
        ops = [base.add(c, s) for c, s in zip(kh.caches, sent)]
        for g, group in enumerate(self.groups):
            packed = update_log.packed([parts[j] for j in group])
            ops += [base.assign(o, x) for o, x in zip(sh.own[g], packed)]
        with tf.control_dependencies(ops):
            ops.append(base.assign(sh.own_pending, tf.constant(1, tf.int64)))
        return ops

    def _mirror_state(self, g: int, sh: StreamHandles) -> list:
        """The mirrors' counterpart of `_ps_state`."""
        state = []
        for j in self.groups[g]:
            v = self.variables[j]
            state.append(base.read(sh.mirrors[j], v.dtype))
            if self.momentum > 0:
                state.append(base.read(sh.momentums[j], v.dtype))
        return state

    def fetch_into_cache(self, kh: base.KindHandles, sh: StreamHandles, worker):
        """Ops of a fetch into the caches (inside the fetch's `tf.cond` branch).

        Args:
          kh: the dense kind's handles (its `ps` and `caches`).
          sh: this module's handles.
          worker: the running replica's index, an integer scalar tensor.

        Returns:
          The ops; the caches hold the fetch once they have run.
        """
        me = tf.cast(worker, tf.int64)
        pending = base.read(sh.own_pending, tf.int64) > 0
        ops = []
        seen_all = base.read(sh.seen, tf.int64)
        # No mirror: the cache becomes the ps values.
        fresh = tf.equal(base.read(sh.mirrored, tf.int64), 0)
        new_seen = []
        for g, group in enumerate(self.groups):
            last = seen_all[g]
            with tf.device(self.variables[group[0]].device):
                seq = base.read(self.log.seqs[g].handle, tf.int64)
                floor = base.read(self.log.floors[g].handle, tf.int64)
                behind = seq - last
                # Or a mirror from before a restore (no `seq` in this
                # process, or of a restarted log), of another log (a
                # restarted ps), or behind the window.
                whole = (
                    fresh
                    | (last < 0)
                    | (last < floor)
                    | (behind < 0)
                    | (behind > self.window)
                )
            before = [base.read(sh.mirrors[j], self.variables[j].dtype) for j in group]

            def whole_fetch(g=g):
                return self._whole(g, sh)

            def stream_fetch(g=g, last=last, behind=behind, seq=seq):
                nbytes, in_sync = self._replay(g, sh, last, behind, me, pending)

                def replayed():
                    return nbytes, seq

                def resync():  # A mirror is off: a whole fetch puts it right.
                    more, at = self._whole(g, sh)
                    counted = base.add(sh.resyncs, tf.constant(1, tf.int64))
                    return base.after([counted], nbytes + more), at

                return tuple(tf.cond(in_sync, replayed, resync))

            nbytes, at = tf.cond(whole, whole_fetch, stream_fetch)
            with tf.control_dependencies([nbytes]):
                for j, old in zip(group, before):
                    v = self.variables[j]
                    after = base.read(sh.mirrors[j], v.dtype)
                    cache = base.read(kh.caches[j], v.dtype)
                    moved = tf.where(fresh, after, cache + (after - old))
                    ops.append(base.assign(kh.caches[j], moved))
                ops.append(base.add(sh.nbytes, nbytes + _SEQ_BYTES))
            new_seen.append(at)
        with tf.control_dependencies(ops):
            ops.append(base.assign(sh.seen, tf.stack(new_seen)))
            ops.append(base.assign(sh.mirrored, tf.constant(1, tf.int64)))
            ops.append(base.assign(sh.own_pending, tf.constant(0, tf.int64)))
        return ops

    def _whole(self, g: int, sh: StreamHandles) -> tuple[tf.Tensor, tf.Tensor]:
        """The group's values, and its momentums once a push has moved them
        (and `outer_momentum` > 0), into the mirrors.

        They are read with the group's `seq` in the pushes' critical section
        (`UpdateLog.locked`): no push lands between the reads, so the mirrors account
        for exactly the pushes below that `seq`.

        Returns:
          `(bytes, seq)`: int64 scalars, `seq` on the ps.
        """
        group = [self.variables[j] for j in self.groups[g]]
        nbytes = sum(v.shape.num_elements() * v.dtype.size for v in group)
        read = {}  # What the section reads, used after it.

        def snapshot():
            with tf.device(group[0].device):
                seq = base.read(self.log.seqs[g].handle, tf.int64)
                read["values"] = [base.read(base.ps_handle(v), v.dtype) for v in group]
                sends = (seq > self.log.origin) & tf.constant(self.momentum > 0)
                read["sends_momentum"] = sends

                def momentums():
                    return tuple(
                        base.read(self.momentums[j].handle, self.variables[j].dtype)
                        for j in self.groups[g]
                    )

                def zeros():
                    return tuple(tf.zeros(v.shape, v.dtype) for v in group)

                read["momentums"] = _as_list(tf.cond(sends, momentums, zeros))
                # Only `seq` leaves the section: the lock is released once the
                # reads are done, not after the values' transfer.
                return base.after(read["values"] + read["momentums"], seq)

        seq = self.log.locked(snapshot)
        ops = []
        for j, value, momentum in zip(
            self.groups[g], read["values"], read["momentums"]
        ):
            ops.append(base.assign(sh.mirrors[j], value))
            ops.append(base.assign(sh.momentums[j], momentum))
        count = tf.where(read["sends_momentum"], 2 * nbytes, nbytes)
        return base.after(ops, tf.cast(count, tf.int64)), seq

    def _replay(self, g: int, sh: StreamHandles, last, behind, me, pending):
        """The logged pushes since `last` replayed into the group's mirrors.

        The replica's own last push (`pending`: not yet replayed) is taken
        from its copy when it is its only push among them; every other push
        (all of them otherwise) is gathered on the ps and sent, each group's
        parts in one tensor per part.

        Returns:
          `(bytes, in_sync)`: an int64 scalar, and a bool scalar, True when
          nothing was replayed or the mirrors' `checksum` after the replay is
          the last replayed entry's.
        """
        group = self.groups[g]
        specs = self.log.part_specs[g]
        with tf.device(self.variables[group[0]].device):
            slots = (last + tf.range(behind, dtype=tf.int64)) % self.log.capacity
            pushers = base.gather(self.log.pushers[g].handle, slots, tf.int64)
            own = tf.equal(pushers, me)
            use_own = pending & tf.equal(tf.reduce_sum(tf.cast(own, tf.int64)), 1)
            sent = tf.logical_not(own & use_own)
            sent_slots = tf.boolean_mask(slots, sent)
            gathered = [
                base.gather(log.handle, sent_slots, dtype)
                for log, (_, dtype) in zip(self.log.logs[g], specs)
            ]
            # Each replayed push's row among `gathered` (own: unused).
            rows = tf.cumsum(tf.cast(sent, tf.int64), exclusive=True)
            newest = (last + behind - 1) % self.log.capacity
            logged_sum = base.gather(self.log.sums[g].handle, newest, tf.int64)
            stalenesses = None
            if self.log.logs_staleness:
                stalenesses = base.gather(
                    self.log.stalenesses[g].handle, slots, tf.int64
                )
        own_parts = [base.read(o, dtype) for o, (_, dtype) in zip(sh.own[g], specs)]
        # A group has one dtype. Cast as `OuterNesterov.update` casts them on
        # the ps (through float32), so that the replay is the ps's update bit
        # for bit.
        dtype = self.variables[group[0]].dtype
        lr = tf.cast(self.learning_rate, dtype)
        mu = tf.cast(self.momentum, dtype)

        def body(i):
            def logged():
                return tuple(x[rows[i]] for x in gathered)

            def mine():
                return tuple(own_parts)

            packed = _as_list(tf.cond(sent[i], logged, mine))
            for x, (n, _) in zip(packed, specs):
                x.set_shape([n])
            updates = []
            staleness = None if stalenesses is None else stalenesses[i]
            for j, parts in zip(group, self.log.unpack(g, packed)):
                v = self.variables[j]
                delta = self.compression.decode(parts, v)
                # As the ps corrects and scales it (`on_ps.PushRules.apply`),
                # the outer momentum's mirror standing for the ps's.
                delta, scale = on_ps.corrected(
                    self.rules,
                    delta,
                    v,
                    None,
                    staleness,
                    lambda name, j=j: _Slot(sh.momentums[j]),
                )
                if scale is not None:
                    delta = delta * scale
                updates.append(
                    tf.raw_ops.ResourceApplyKerasMomentum(
                        var=sh.mirrors[j],
                        accum=sh.momentums[j],
                        lr=lr,
                        grad=delta,
                        momentum=mu,
                        use_locking=False,
                        use_nesterov=True,
                    )
                )
            return base.after(updates, i + 1)

        done = tf.while_loop(lambda i: i < behind, body, [tf.constant(0, tf.int64)])
        with tf.control_dependencies([done]):
            mirror_sum = update_log.checksum(self._mirror_state(g, sh))
        in_sync = tf.equal(behind, 0) | tf.equal(mirror_sum, logged_sum)
        count = tf.size(sent_slots, out_type=tf.int64)
        per_push = _ID_BYTES + (_ID_BYTES if self.log.logs_staleness else 0)
        nbytes = behind * per_push + count * self.log.part_nbytes[g] + _SUM_BYTES
        return base.after([done], nbytes), in_sync


class _Slot(NamedTuple):
    """A mirror of a rule's ps state as its `correct` reads one (`handle`)."""

    handle: tf.Tensor


def _as_list(outputs) -> list:
    """A `tf.cond`'s outputs as a list (it returns a lone output bare)."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
