"""The TensorFlow and tf_keras internals tf_distbelief relies on: the one place.

Everything else in the package uses public APIs only (ruff's SLF001 rule is on
for every module outside this package). Each entry says why it is needed and
which public route was checked and found missing in TensorFlow 2.21 / tf_keras
2.21; each module's `check()` verifies that its internals still have the shape
relied on, and `check()` here runs them all (`tests/test_tf_internals.py`
fails naming the TensorFlow version). One module per area:

* `variables`: tf.distribute's variable classes (`CachingVariable`,
  `PerWorkerVariable`, `AggregatingVariable`, `ShardedVariable`,
  `ResourceVariable`), a sharded variable's shards, a per-worker variable's
  copies, and a variable's class swap (`swap_class`, for `substitution`).
* `optimizers`: a tf_keras optimizer's clipping, per-variable update and
  cross-replica apply.
* `keras_model`: what tf_keras `fit` keeps on a model (train counter,
  coordinator, `steps_per_execution`, per-replica reduction), and method
  overrides on a user's model (`override_method`, `override_train_function`).
* `coordinator`: a `ClusterCoordinator`'s threads, worker recovery,
  closure queue, and its per-worker datasets and iterators kept while
  connected (`KeepingCoordinator`, the strategy's own coordinator).
* `eager_context`: functions kept registered on remote tasks while connected
  (`keep_remote_functions`), leaving a cluster's tasks (`disconnect_from_tasks`).
* `saved_model`: the object graph a checkpoint was saved from.
* `checkpoint_manager`: a checkpoint written by a traced function, recorded
  by its `tf.train.CheckpointManager` (`record_written`).
* `control_flow`: a `tf.cond` whose branch, once begun, runs to its end
  (`whole_cond`, for exactly-once step tokens), and one whose branches are
  calls not inlined (`called_cond`: a branch not taken sends nothing).
* `server_runtime`: a ps or worker task's server without TensorFlow's Python
  API (`load(lean=True)`).
* `autograph`: the source files autograph writes, removed by a process that
  ends through `os._exit` (`remove_generated_files`).
* `worker_inputs`: a value fed to each worker's call of a function traced
  once for all workers (`per_worker_input`: each worker sent its own shard).
"""

import importlib

# The modules, by name: importing this package imports none of them, so that
# a ps or worker task can load `server_runtime` before any TensorFlow import.
MODULE_NAMES = (
    "variables",
    "optimizers",
    "keras_model",
    "coordinator",
    "eager_context",
    "saved_model",
    "checkpoint_manager",
    "control_flow",
    "server_runtime",
    "autograph",
    "worker_inputs",
)


def modules() -> tuple:
    """The modules of `MODULE_NAMES`, imported."""
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in MODULE_NAMES)


def check() -> None:
    """Runs every module's `check()`; fails on the first internal changed."""
    for module in modules():
        module.check()
