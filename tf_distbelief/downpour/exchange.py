"""A Downpour replica's exchanges with the ps: fetches and pushes.

Dean et al. 2012, section 4.1. A fetch copies the parameters into the
replica's cache and records the ps update count it accounts for; a push sends
the gradients summed since the last push (and their squares, see
`plan.PushedSquares`), unless too stale (`DownpourConfig.max_staleness`),
applies the user's tf_keras optimizer to them on each variable's ps shard,
and counts the update on the ps; a push with a NaN or inf is never applied
(`push_guard`). The variables of each kind move as that kind
says (`dense.DenseVariables`, `row_sparse.RowSparseVariables`); both run in
`tf.cond` branches, so that a step without them sends nothing. With a
compressing push rule the dense sums plus the replica's residual are encoded
on the worker and only the encoded parts move (`push_rules.compression`); an
applied push keeps what it did not send in the residual. With sparse fetches
(`sparse_fetch`) a fetch moves only the entries the ps changed since the
replica's last fetch, which each applied push flags. With the outer rule and
compression (`stream_fetch`) the residual is the cache itself: a push sends
the compressed difference of the replica's mirror of the ps and its cache,
the ps logs it, and a fetch replays the pushes logged since the last one.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.downpour import base, push_guard, schedule
from tf_distbelief.downpour.config import DownpourConfig
from tf_distbelief.downpour.dense import DenseVariables
from tf_distbelief.downpour.row_sparse import RowSparseVariables
from tf_distbelief.faults import exactly_once
from tf_distbelief.tf_internals import control_flow
from tf_distbelief.tf_internals import optimizers as tf_optimizers

__all__ = ["Exchange"]


# What became of a push, the gated branch's third output (made in the branch,
# so that nothing it returns comes from the worker): the replica's own
# counters (per-worker variables) are written from it after the gate, on the
# worker, and the branch touches the ps only (`exactly_once.gate` keeps it
# whole there).
# How a push ended. `_HALTED`: refused quietly, after a push refused with
# `raise` stopped the job's pushes (`push_guard`, "Halt").
_DUPLICATE, _APPLIED, _DROPPED, _REFUSED, _HALTED = range(5)


class Exchange:
    """Fetches and pushes of one replica (the ops, for its step functions).

    Args:
      optimizer: the tf_keras optimizer applied on the ps to each push.
      config: the `DownpourConfig`.
      variables: the replica's variables (shards), in order.
      order: the `base.KindOrder` of `variables`.
      dense: the dense variables' handler.
      rows: the row-sparse variables' handler.
      guard_context: the `push_guard.Guard` of the replica's `Downpour`: what
        a refused push does (its `nonfinite` mode, read when traced).
      tokens: the optimizer's `exactly_once.StepTokens`, or None.
      rules: the `push_rules.PushRules`, or None when every rule is off.
      compression: the `push_rules.compression.CompressedPush`, or None when
        no rule compresses pushes.
      sparse: the `sparse_fetch.SparseFetch`, or None without sparse fetches.
      stream: the `stream_fetch.StreamFetch`, or None without update-stream
        fetches.
    """

    def __init__(
        self,
        optimizer,
        config: DownpourConfig,
        variables: list,
        order: base.KindOrder,
        dense: DenseVariables,
        rows: RowSparseVariables,
        guard_context,
        tokens,
        rules,
        compression=None,
        sparse=None,
        stream=None,
    ):
        self.optimizer = optimizer
        self.config = config
        self.variables = variables
        self.order = order
        self.dense = dense
        self.rows = rows
        # What the non-finite guard does with a refused push: `replica.Downpour`
        # (its `nonfinite` mode, read when the step is traced).
        self.guard_context = guard_context
        # The optimizer's `exactly_once.StepTokens`: each push is gated by the
        # token of the step that ends it, when one is in scope.
        self.tokens = tokens
        # The `push_rules.on_ps.PushRules`, None when all off.
        self.rules = rules
        self.compression = compression
        self.sparse = sparse
        self.stream = stream

    @property
    def push_nbytes(self) -> int:
        """Bytes an applied push moves of the dense variables: compressed, or
        the model (twice with the squares, `plan.Plan.push_copies`)."""
        if self.compression is not None:
            return self.compression.nbytes
        return self.dense.plan.push_copies * self.dense.nbytes

    def record(self, h: base.Handles):
        """The `DenseVariables.pull` `record` of delay compensation, or None."""
        if self.rules is None or not self.rules.fetched:
            return None
        return lambda j, value: self.rules.record_fetch(j, value, h.worker)

    def fetch_ops(self, h: base.Handles) -> list:
        """A fetch's bookkeeping: `seen`, `refetch`, the count, stale rows."""
        ops = [
            base.assign(h.seen, base.read(h.count, tf.int64)),
            base.assign(h.refetch, tf.constant(0, tf.int64)),
            base.add(h.stats["fetches"], tf.constant(1, tf.int64)),
        ]
        return ops + self.rows.mark_stale(h.rows)

    def fetch_values(self, h: base.Handles) -> tuple[list, tf.Tensor]:
        """A fetch every step, read directly (no cache): `(dense values, done)`.

        `done` is True once the fetch's bookkeeping (`fetch_ops`) has run.
        """
        records = []
        dense = self.dense.pull(h.dense, False, self.record(h), records)
        return dense, base.after(self.fetch_ops(h) + records, True)

    def fetch_due(self, h: base.Handles, t: tf.Tensor) -> tf.Tensor:
        """True when step `t` starts with a fetch: the cadence, or a drop."""
        refetch = base.read(h.refetch, tf.int64) > 0
        return schedule.is_fetch_step(t, self.config.n_fetch) | refetch

    def fetch_if(self, h: base.Handles, pred: tf.Tensor) -> tf.Tensor:
        """A fetch into the cache when `pred`, in a `tf.cond`: True if done."""

        def fetch():
            if self.stream is not None:
                moved = self.stream.fetch_into_cache(h.dense, h.stream, h.worker)
            elif self.sparse is None:
                moved = self.dense.fetch_into_cache(h.dense, self.record(h))
            else:
                moved = self.sparse.fetch_into_cache(h.dense, h.sparse, h.worker)
            return base.after(self.fetch_ops(h) + moved, True)

        return self._cond(pred, fetch, lambda: tf.constant(False))

    def push_if(self, h: base.Handles, pred: tf.Tensor, step=None):
        """A push of the accumulators when `pred`, in a `tf.cond` (`push`)."""

        def push():
            pushed = (self.dense.accumulated(h.dense), self.rows.accumulated(h.rows))
            outputs, refusal = self._push(
                h, pushed, zero_accumulators=True, pack=True, step=step
            )
            return (*outputs, *refusal)

        def no_push():
            int64 = tf.int64
            none = (tf.constant(-1, int64), tf.constant(False), tf.constant(0, int64))
            flags = tf.ones([len(self.variables)], tf.bool)
            return (*none, tf.constant(False), flags, tf.constant(0, int64))

        result = self._cond(pred, push, no_push)
        return self._raise_on(h, result[:3], result[3:])

    def _cond(self, pred, true_fn, false_fn):
        """The `tf.cond` of a fetch or push: with update-stream fetches each
        branch is a function call, so that the branch not taken sends no
        dead tensor over its many edges between the worker and the ps tasks
        (`control_flow.called_cond`)."""
        if self.stream is None:
            return tf.cond(pred, true_fn, false_fn)
        return control_flow.called_cond(pred, true_fn, false_fn)

    def push(
        self,
        h: base.Handles,
        pushed,
        zero_accumulators: bool,
        pack: bool,
        step=None,
    ):
        """Pushes `pushed` unless too stale or not finite (`_push`); with
        `raise`, fails on a push refused for a NaN or inf (`_raise_on`)."""
        outputs, refusal = self._push(h, pushed, zero_accumulators, pack, step)
        return self._raise_on(h, outputs, refusal)

    def _raise_on(self, h: base.Handles, outputs, refusal):
        """`outputs`, after the `raise` mode's check of `refusal`.

        The check runs on the worker, after the push and outside any called
        branch (`_cond`) and any lock: an assertion that fails inside a
        function call reaches the coordinator as a derived cancellation,
        which it drops.
        """
        if self.guard_context.mode != "raise":
            return outputs
        refused, flags, step = refusal
        check = push_guard.raise_if_refused(h, self.variables, flags, step, refused)
        return tuple(base.after([check], x) for x in outputs)

    def _push(
        self,
        h: base.Handles,
        pushed,
        zero_accumulators: bool,
        pack: bool,
        step=None,
    ):
        """Pushes `pushed` unless too stale or not finite.

        Args:
          h: the handles.
          pushed: `((grads, squares), (grads, squares))`, dense then
            row-sparse (`base.VariableKind.accumulated`).
          zero_accumulators: restart the accumulators after the push.
          pack: pack the dense variables by group (`dense.DenseVariables`).
          step: the replica's local step the push ends (1-based), an int64
            scalar, for the non-finite guard's error; None reads the step
            counter.

        Returns:
          `((staleness, applied, row_bytes), (refused, flags, step))`:
          scalars int64, bool, int64, where `row_bytes` is what the push sent
          of row-sparse variables (`RowSparseVariables.bytes_pushed`), 0 if
          dropped, and a push refused for a NaN or inf (`push_guard`) has
          staleness -1, as no push; then whether `raise` refused this push
          (the first to, which set the halt), the bool `[variables]`
          finiteness flags, and the int64 step.

        Staleness is the number of pushes by other replicas between this
        replica's fetch and its push. Without `max_staleness` it is read back
        with the update, in the same round trip: the ps update count after
        this push's increment, less 1, less the count at the fetch (a push
        landing between the increment and the read is counted too). With
        `max_staleness` it is read before the push, which then waits for it.

        With compression, the finiteness check is of the dense sums plus the
        residual (what is left unsent too), and only an applied push updates
        the residual. With update-stream fetches what is compressed and
        checked is the mirror less the cache, and an applied push adds what
        it sent to the cache (`stream_fetch`).
        """
        int64 = tf.int64
        (dense_grads, dense_squares), (row_grads, row_squares) = pushed
        row_bytes = self.rows.bytes_pushed(row_grads)
        squares = None
        if dense_squares is not None:
            squares = self.order.merge(dense_squares, row_squares)
        coded = None  # A compressed push's parts (`CompressedPush.encode`).
        checked = dense_grads
        if self.stream is not None:
            checked = self.stream.unsent(h.dense, h.stream)
            coded, sent = self.compression.encode_values(checked)

            def kept_residuals():
                return self.stream.keep_sent(h.dense, h.stream, sent, coded)

        elif self.compression is not None:
            residuals = h.residuals
            checked, coded, sent = self.compression.encode(residuals, dense_grads)

            def kept_residuals():
                return self.compression.keep_residuals(residuals, checked, sent)

        flags = push_guard.finite_flags(self.order.merge(checked, row_grads), squares)
        if step is None:
            step = base.read(h.stats["steps"], int64) + 1
        guard = self.guard_context

        # After a push refused with `raise`, no later push is applied
        # (`push_guard`, "Halt"); the flag is read on the ps.
        halted = tf.not_equal(base.read(h.halted, int64), 0)

        def refuse():
            if guard.mode == "raise":
                # The first refusal sets the halt, on the ps under the lock;
                # the step then fails on the worker (`_raise_on`).
                code = tf.cond(
                    halted,
                    lambda: tf.constant(_HALTED, int64),
                    lambda: base.after(
                        [base.assign(h.halted, tf.constant(1, int64))],
                        tf.constant(_REFUSED, int64),
                    ),
                )
                ops = [code]
            else:
                ops = [base.add(h.skipped, tf.constant(1, int64))]  # On the ps.
                code = tf.constant(_REFUSED, int64)
            outputs = (
                base.after(ops, tf.constant(-1, int64)),
                base.after(ops, False),
                base.after(ops, code),
            )
            return outputs, []

        # The push as received on the ps, before the gate: its update reads
        # these, so that no transfer runs under the token's lock (and a push
        # refused or dropped for staleness has sent its sums too). The
        # replica's count of pushes seen is read here too: a per-worker
        # variable.
        grads_on_ps, squares_on_ps, parts_on_ps = self._to_ps(pushed, pack, coded)
        seen = exactly_once.copy_to(
            self.optimizer.iterations.device, base.read(h.seen, int64)
        )
        reads_first = self.rules is not None and self.rules.reads_staleness_first
        if self.config.max_staleness is None and not reads_first:

            def apply_push():
                arrived = self._apply(
                    grads_on_ps, squares_on_ps, None, h.worker, parts_on_ps
                )
                # Counted once the push has reached the ps, not before: a
                # control edge on a tensor already there costs no message (one
                # per ps task otherwise).
                with tf.control_dependencies(arrived[:1]):
                    increment = base.add(h.count, tf.constant(1, int64))
                with tf.control_dependencies([increment]):
                    count = base.read(h.count, int64)
                staleness = count - 1 - seen
                outputs = staleness, tf.constant(True), tf.constant(_APPLIED, int64)
                return outputs, [count]  # `count`: on the ps, after the push.

        else:

            def apply_push():
                staleness = base.read(h.count, int64) - seen

                def apply_fresh():
                    arrived = self._apply(
                        grads_on_ps, squares_on_ps, staleness, h.worker, parts_on_ps
                    )
                    with tf.control_dependencies(arrived[:1]):
                        increment = base.add(h.count, tf.constant(1, int64))
                    return base.after([increment], tf.constant(_APPLIED, int64))

                if self.config.max_staleness is None:
                    status = apply_fresh()
                else:
                    status = tf.cond(
                        staleness <= self.config.max_staleness,
                        apply_fresh,
                        lambda: tf.constant(_DROPPED, int64),
                    )
                # A dropped push is marked too: its retry would be as stale.
                outputs = (
                    base.after([status], staleness),
                    tf.equal(status, _APPLIED),
                    status,
                )
                return outputs, [base.read(h.count, int64)]

        ready = tf.logical_and(tf.reduce_all(tf.stack(flags)), tf.logical_not(halted))
        token = exactly_once.current()
        if token is None or self.tokens is None:

            def apply_now():
                if self.stream is None:
                    return apply_push()[0]
                # The update and its log entry in the section a gated push
                # takes (`stream_fetch`, "Ordering").
                return self.stream.log.locked(lambda: apply_push()[0])

            staleness, applied, status = tf.cond(ready, apply_now, lambda: refuse()[0])
        else:
            # A retried step whose push was applied already pushes nothing;
            # its sums restart, as after a push dropped for staleness.
            staleness, applied, status = exactly_once.gate(
                token,
                self.tokens,
                ready,
                apply_push,
                refuse,
                lambda: (
                    tf.constant(-1, int64),
                    tf.constant(False),
                    tf.constant(_DUPLICATE, int64),
                ),
            )
        one = tf.constant(1, int64)

        def when(code, make_ops):
            """`make_ops()` (the replica's counters) if the push ended as `code`."""

            def run():
                return base.after(make_ops(), True)

            return tf.cond(tf.equal(status, code), run, lambda: tf.constant(False))

        def on_applied():
            ops = [
                base.add(h.seen, one),
                base.add(h.stats["pushes"], one),
                base.add(h.stats["row_bytes_pushed"], row_bytes),
            ]
            if coded is not None:
                ops += kept_residuals()
            return ops

        def on_dropped():
            return [
                base.assign(h.refetch, one),
                base.add(h.stats["dropped_pushes"], one),
            ]

        def on_refused():
            # The replica refetches and its local accumulators go back to
            # their pushed base.
            ops = [
                base.assign(h.refetch, one),
                base.add(h.stats["nonfinite_pushes"], one),
            ]
            for kind, kh in ((self.dense, h.dense), (self.rows, h.rows)):
                ops += kind.repair_local_accumulators(kh, zero_accumulators)
            if self.stream is not None:  # The cache took the NaN: reset it.
                ops += self.stream.drop_mirrors(h.stream)
            return ops

        # With `raise` too: the step fails after the push (`_raise_on`), its
        # replica ready for the next fit.
        counted = [
            when(_APPLIED, on_applied),
            when(_DROPPED, on_dropped),
            when(_REFUSED, on_refused),
        ]
        with tf.control_dependencies([applied, staleness, *counted]):
            most = base.read(h.stats["max_staleness_seen"], int64)
            ops = [
                # A refused push (-1) adds nothing.
                base.add(h.stats["staleness_sum"], tf.maximum(staleness, 0)),
                base.assign(h.stats["max_staleness_seen"], tf.maximum(staleness, most)),
            ]
            if zero_accumulators:
                ops += self.dense.restart(h.dense, dense_grads)
                ops += self.rows.restart(h.rows, row_grads)
        with tf.control_dependencies(ops):
            sent = tf.where(applied, row_bytes, tf.constant(0, int64))
            outputs = tf.identity(staleness), tf.identity(applied), sent
        refused = tf.logical_and(
            tf.equal(status, _REFUSED), tf.constant(guard.mode == "raise")
        )
        refused = base.after(list(outputs), refused)  # Checked once all ran.
        return outputs, (refused, tf.stack(flags), tf.cast(step, int64))

    def _to_ps(self, pushed, pack: bool, coded=None) -> tuple[list, list]:
        """One push as tensors on the variables' ps tasks, clipped.

        Gradient clipping, if the optimizer has it, applies to the gradients,
        not to their squares. A compressed push (`coded`:
        `CompressedPush.encode`'s parts) sends the parts and is decoded on the
        ps; clipping applies to the decoded values.

        Args:
          pushed: as `push` takes it.
          pack: pack the dense variables by group (`dense.DenseVariables`).
          coded: a compressed push's parts, or None.

        Returns:
          `(grads, squares, parts)`, one entry per variable in order;
          `squares` entries are None where no squares are pushed; `parts`:
          a compressed push's encoded parts as received on the ps, per
          variable, or None.
        """
        opt, order = self.optimizer, self.order
        (dense_grads, dense_squares), (row_grads, row_squares) = pushed
        if coded is not None:
            # Rules take no row-sparse variables: all are dense, no squares.
            decoded, parts = self.compression.to_ps(coded, self.dense.groups())
            clipped = tf_optimizers.clip_gradients(opt, decoded)
            return clipped, [None] * len(decoded), parts
        clipped = tf_optimizers.clip_gradients(opt, order.merge(dense_grads, row_grads))
        dense_grads, row_grads = order.split(clipped)
        grads = order.merge(
            self.dense.to_ps(dense_grads, pack), self.rows.to_ps(row_grads)
        )
        squares = [None] * len(grads)
        if dense_squares is not None:
            squares = order.merge(
                self.dense.to_ps(dense_squares, pack), self.rows.to_ps(row_squares)
            )
        return grads, squares, None

    def _apply(self, grads, squares, staleness=None, worker=None, parts=None) -> list:
        """Applies one push with the optimizer, variable by variable on its shard.

        The update ops (and the optimizer's casts of its hyperparameters) run
        on the variable's ps task, as `tf.distribute`'s `extended.update` would
        place them. With `n_push > 1`, `tf_distbelief.adagrad.Adagrad` grows
        its accumulator by the pushed squares (`apply_gradient_and_squares`)
        or counts the push as `n_push` updates (`apply_summed_gradient`), as
        `config.adagrad_accumulator` says. With a push rule on,
        `push_rules.on_ps.PushRules.apply` applies it (`staleness`: read
        before the push when the rule needs it; `worker`: the replica's
        index). With update-stream fetches each variable's push is logged
        after its update (`update_log.UpdateLog.append`), and the
        returned tensors come after the log's entries.

        Args:
          grads, squares, parts: `_to_ps`'s, on the ps tasks.
          staleness: an int64 scalar, or None.
          worker: the replica's index, an int64 scalar, or None.

        Returns:
          `grads`.
        """
        opt = self.optimizer
        mode = self.config.adagrad_accumulator
        steps = self.config.n_push if mode == "mean" else 1
        if self.rules is not None and self.rules.any:
            # Row-sparse variables are refused with the rules: all are dense.
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            updates = self.rules.apply(grads, squares, steps, staleness, worker)
            if self.stream is not None:
                appended = self.stream.log.append(parts, updates, worker, staleness)
                # What follows the push (its count, the token's write, the
                # critical section's release) follows its log entries too.
                grads = [
                    _after_on(v.device, appended, g)
                    for g, v in zip(grads, self.variables)
                ]
            if self.sparse is not None:
                # Flagged after every op of the update (`sparse_fetch.mark`).
                self.sparse.mark(grads, graph.get_operations()[first:])
            opt.iterations.assign_add(1)
            return grads
        for g, sq, v in zip(grads, squares, self.variables):
            with tf.device(v.device):
                base.apply_push(opt, g, sq, v, steps)
        opt.iterations.assign_add(1)
        return grads


def _after_on(device: str, ops: list, value):
    """`value` after `ops`, on `device` (where `value` is, so that nothing
    moves)."""
    with tf.device(device):
        return base.after(ops, value)
