"""Each Downpour replica's own state in checkpoints, for an exact resume.

Dean et al. 2012, section 4.1, with TensorFlow's checkpoints
(`tf.train.Checkpoint`). A replica keeps its state on its worker, in
`per_worker_variable=True` variables (`Downpour.worker_variables`): its cache,
its gradient sums not yet pushed, the squares to push, its local AdaGrad
accumulator, the residual of compressed pushes, its step counter (the fetch
and push cadence), the ps update count its cache accounts for, and its
counters (`Downpour.stats`). TensorFlow
saves only the coordinator's copy of such a variable, its initial value.

`ReplicaState` is a `tf.Module` that `training.fit` puts in its checkpoint as
`downpour`: per replica (worker index `i`), a coordinator-side copy of each
of those variables (`replicas/<i>/values/<key>`, keyed by position, e.g.
`dense/local_accumulator/0`: `Downpour.worker_variables`) and `saved` (1: the
copy is the replica's state, 0: the replica starts fresh), with the ps variables
`update_count` (staleness) and `warm_steps` (the warm start). Before each
save, `capture` reads every worker's variables into the copies (one function
call per worker, after the coordinator's `join`); after a restore,
`write_back` writes replica `i`'s copies into worker `i`'s variables. With
the same workers, a resumed run then equals an uninterrupted one bit for bit
at any step (1 worker, fixed data; `tests/test_downpour_resume.py`).

Rules, each printed when it applies (the user's view: docs/reliability.md,
"Downpour replicas"): a replica that cannot be read at a save (its worker
lost, not back within `WAIT_SECS`) or whose state holds a NaN or inf is saved
as "start fresh" (`saved` 0); a checkpoint with no `downpour` state restores
the rest and every replica starts fresh; with another number of workers,
replicas `0 .. min - 1` get their state back, new ones start fresh and the
rest is dropped (at most `n_push - 1` unpushed steps each, as on the loss of
a worker); a value whose shape or dtype does not fit (another model or
`DownpourConfig`) is a `resume.RestoreError` naming the variable. A worker
lost and restarted during a run starts fresh whatever the checkpoints hold:
TensorFlow re-creates its per-worker variables at their initial values.

The coordinator holds one copy of each replica's state (up to 5 copies of
the model per replica, `Downpour`, "Worker memory"; a row-sparse table's
cache whole), and each save reads it from the workers over the network.

With a custom loop (`keras.DownpourTrainer`):
  ```
  replicas = replica_state.ReplicaState(trainer.downpour)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                   downpour=replicas)
  trainer.join(); replicas.capture(); checkpoint.save(prefix)
  # Resuming: restore first, then each replica's state to its worker.
  checkpoint.restore(path); replicas.write_back(replicas)
  ```
"""

from __future__ import annotations

import re

import tensorflow as tf
from absl import logging

from tf_distbelief.downpour import base
from tf_distbelief.downpour.replica import Downpour
from tf_distbelief.tf_internals import variables as tf_variables

__all__ = ["WAIT_SECS", "ReplicaState", "saved_replicas"]

# How long a save or restore waits for a worker's per-worker variables to be
# there (created, or rebuilt after a restart) before it gives up on them.
WAIT_SECS = 60.0
# Where `training.fit` puts a `ReplicaState` in its checkpoint.
CHECKPOINT_KEY = "downpour"
_REPLICA_KEY = re.compile(rf"^{CHECKPOINT_KEY}/replicas/(\d+)/saved/")


def saved_replicas(keys) -> int | None:
    """Replicas whose state a checkpoint holds, from its keys; None for none.

    Args:
      keys: the checkpoint's variable keys (`tf.train.list_variables`).
    """
    found = {int(m.group(1)) for k in keys if (m := _REPLICA_KEY.match(k))}
    return max(found) + 1 if found else None


def _described(downpour: Downpour, key: str) -> str:
    """`key` of `Downpour.worker_variables` with its ps variable's name, for
    errors: `dense/cache/0` is `dense/cache/0/logits/kernel/part_0`."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] not in ("dense", "rows"):
        return key
    rows = parts[0] == "rows"
    kind = [v for v, r in zip(downpour.variables, downpour.row_sparse) if r == rows]
    return f"{key}/{base.slug(kind[int(parts[2])].name)}"


class _Replica(tf.Module):
    """One replica's copies: `values` by key, `saved` (int64 scalar, 1/0)."""

    def __init__(self, index: int, downpour: Downpour):
        super().__init__(name=f"replica{index}")
        with tf.init_scope():
            self.saved = tf.Variable(
                tf.constant(0, tf.int64),
                trainable=False,
                name=f"downpour/replica{index}/saved",
            )
            self.values = {
                key: tf.Variable(
                    tf.zeros(v.shape, v.dtype),
                    trainable=False,
                    name=f"downpour/replica{index}/{_described(downpour, key)}",
                )
                for key, v in downpour.worker_variables().items()
            }


class ReplicaState(tf.Module):
    """The replicas' worker-resident Downpour state, as a checkpointable object.

    Create it outside any strategy scope (its copies live on the
    coordinator).

    Args:
      downpour: the `Downpour` (`downpour.install`'s, `hooks.of(model).state`).
      num_replicas: replicas to hold copies for; None: the strategy's workers.

    Attributes:
      replicas: per worker index, its copies (`values`, `saved`).
      update_count, warm_steps: `downpour`'s ps variables of those names.
    """

    def __init__(self, downpour: Downpour, num_replicas: int | None = None):
        super().__init__(name=CHECKPOINT_KEY)
        if num_replicas is None:
            num_replicas = max(1, getattr(downpour.strategy, "num_workers", 1))
        # A plain object, so not tracked: the checkpoint holds the copies,
        # not the per-worker variables (whose saved value is the initial one).
        self._downpour = downpour
        self.update_count = downpour.update_count
        self.warm_steps = downpour.warm_steps
        self.replicas = [_Replica(i, downpour) for i in range(num_replicas)]
        self._copiers = _Copiers()

    @property
    def _named(self) -> dict:
        return self._downpour.worker_variables()

    def restoring(self, keys) -> ReplicaState | None:
        """What a checkpoint with `keys` restores replica state into.

        Returns:
          None when it holds none; this object when it holds as many
          replicas; else a `ReplicaState` of the checkpoint's replica count
          (`write_back` then applies the module's rule).
        """
        saved = saved_replicas(keys)
        if saved is None or saved == len(self.replicas):
            return None if saved is None else self
        return ReplicaState(self._downpour, saved)

    def _worker_variables(self, index: int) -> dict | None:
        """Worker `index`'s own variables by name; None if it is not there."""
        out = {}
        for name, v in self._named.items():
            out[name] = tf_variables.worker_variable(v, index, WAIT_SECS)
            if out[name] is None:
                return None
        return out

    def _set_fresh(self, replica: _Replica) -> None:
        # The coordinator's own copy of a per-worker variable keeps its
        # initial value: only workers' copies are written.
        for name, v in self._named.items():
            replica.values[name].assign(v.read_value())
        replica.saved.assign(0)

    def capture(self) -> list[str]:
        """Reads every replica's state from its worker into the copies.

        Call it when no step is in flight (after `ClusterCoordinator.join`).

        Returns:
          A line per replica saved as "start fresh", saying why (empty when
          every replica was saved).
        """
        lines = []
        for i, replica in enumerate(self.replicas):
            why = None
            try:
                values = self._worker_variables(i)
                if values is None:
                    why = f"its worker did not answer within {WAIT_SECS:g} s"
                else:
                    bad = self._copiers.copy(i, replica, values)
                    if bad:
                        why = f"{', '.join(bad[:3])} hold NaN or inf"
            except tf.errors.OpError as e:
                why = f"reading it from its worker failed ({type(e).__name__})"
            if why is None:
                replica.saved.assign(1)
            else:
                self._set_fresh(replica)
                lines.append(
                    f"Downpour replica {i} saved as 'start fresh': {why}; a "
                    "resume from this checkpoint starts it anew (its first "
                    "step fetches)."
                )
                logging.warning("%s", lines[-1])
        return lines

    def write_back(self, restored: ReplicaState | None) -> list[str]:
        """Writes `restored`'s copies into the workers' variables.

        Replica `i`'s copies go to worker `i`; workers with no saved state
        (see the module's rules) get their variables' initial values.

        Args:
          restored: what a checkpoint was restored into (`num_replicas` its
            `saved_replicas`), or None when it held no replica state.

        Returns:
          Lines saying which replicas start fresh and why (empty when every
          replica got its state back).

        Raises:
          RuntimeError: a worker's variables are not there within
            `WAIT_SECS`, or a value read back differs from the one written.
        """
        saved = 0 if restored is None else len(restored.replicas)
        self._downpour.after_restore()
        lines = []
        if restored is None:
            lines.append(
                "The checkpoint holds no Downpour replica state (written "
                "before it was saved, or without Downpour): every replica "
                "starts fresh (its first step fetches; its local AdaGrad "
                "accumulator at its initial value)."
            )
        elif saved != len(self.replicas):
            lines.append(
                f"The checkpoint holds the state of {saved} Downpour replicas; "
                f"this run has {len(self.replicas)} workers: replicas "
                f"0..{min(saved, len(self.replicas)) - 1} get theirs back"
                + (
                    f", {len(self.replicas) - saved} new ones start fresh"
                    if saved < len(self.replicas)
                    else f", the state of replicas {len(self.replicas)}.."
                    f"{saved - 1} is dropped (their unpushed gradients)"
                )
                + "."
            )
        for i in range(len(self.replicas)):
            source = restored.replicas[i] if i < saved else None
            if source is not None and not int(source.saved.numpy()):
                lines.append(
                    f"Downpour replica {i} was saved as 'start fresh': it starts anew."
                )
            values = self._worker_variables(i)
            if values is None:
                raise RuntimeError(
                    f"Could not restore Downpour replica {i}: worker {i}'s "
                    f"variables were not there within {WAIT_SECS:g} s. Check "
                    "that the worker task serves, then rerun with the same "
                    "`model_dir`."
                )
            for name, v in values.items():
                value = (
                    self._named[name].read_value()
                    if source is None
                    else source.values[name].read_value()
                )
                v.assign(value)
                back = v.read_value()
                if not bool(tf.reduce_all(tf.equal(back, value))):
                    raise RuntimeError(
                        f"Downpour replica {i}'s `{name}` reads back from worker "
                        f"{i} other than it was written."
                    )
        for line in lines:
            logging.info("%s", line)
        return lines


class _Copiers:
    """Per replica, one function that copies its worker's variables.

    Copying variable by variable costs an eager remote read and a local
    assign each (about 0.2 s per checkpoint for digits' 2 replicas); one
    traced function per replica does it in one call. A plain object, not
    tracked by the `tf.Module` (nothing of it is checkpointed).
    """

    def __init__(self):
        self._by_replica = {}

    def copy(self, index: int, replica: _Replica, values: dict) -> list[str]:
        """Copies `values` (worker `index`'s variables, by name) into
        `replica`'s copies; returns the names of those holding a NaN or inf.

        The function is traced again when the worker's variables are not the
        ones it was traced for (a restarted worker gets new ones).
        """
        key = tuple(id(v) for v in values.values())
        cached = self._by_replica.get(index)
        if cached is None or cached[0] != key:
            pairs = [(replica.values[name], v) for name, v in values.items()]
            checked = [n for n, v in values.items() if v.dtype.is_floating]

            @tf.function(autograph=False)
            def copy():
                finite = [tf.constant(True)]
                for dst, src in pairs:
                    x = src.read_value()
                    dst.assign(x)
                    if x.dtype.is_floating:
                        finite.append(tf.reduce_all(tf.math.is_finite(x)))
                return tf.stack(finite[1:] or finite)

            # `pairs` holds the variables, so no id in `key` is reused.
            cached = (key, copy, checked, pairs)
            self._by_replica[index] = cached
        _, copy, checked, _ = cached
        finite = copy().numpy()
        return [name for name, ok in zip(checked, finite) if not ok]
