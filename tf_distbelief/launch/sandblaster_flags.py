"""The Sandblaster L-BFGS flags of `tf-distbelief-train`, one per config field.

Dean et al. 2012, section 4.2; `tf_distbelief.sandblaster.SandblasterConfig`
holds the settings and their defaults, which the flags take.
"""

from __future__ import annotations

import math

from absl import flags

from tf_distbelief import sandblaster

# `SandblasterConfig` field -> the flag that sets it.
FIELDS = {
    "history": "lbfgs_history",
    "max_iters": "lbfgs_max_iters",
    "portions": "portions",
    "backup_tasks": "backup_tasks",
    "checkpoint_every_iters": "lbfgs_checkpoint_every_iters",
    "log_every_iters": "lbfgs_log_every_iters",
    "two_loop": "lbfgs_two_loop",
    "stall_timeout_secs": "portion_stall_timeout_secs",
}


def define_flags() -> None:
    """Defines the Sandblaster flags (absl), their defaults `SandblasterConfig`'s."""
    sb = sandblaster.SandblasterConfig()
    flags.DEFINE_integer(
        "lbfgs_history",
        sb.history,
        "Sandblaster: (s, y) pairs L-BFGS keeps on the ps.",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "lbfgs_max_iters",
        sb.max_iters,
        "Sandblaster: L-BFGS iterations at most.",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "portions", sb.portions, "Sandblaster: work portions per batch.", lower_bound=1
    )
    flags.DEFINE_bool(
        "backup_tasks",
        sb.backup_tasks,
        "Sandblaster: copies of the last portions go to idle workers.",
    )
    flags.DEFINE_integer(
        "lbfgs_checkpoint_every_iters",
        sb.checkpoint_every_iters,
        "Sandblaster: with --model_dir, checkpoint the L-BFGS state every so many "
        "iterations; a rerun with the same --model_dir resumes at the last one.",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "lbfgs_log_every_iters",
        sb.log_every_iters,
        "Sandblaster: a progress line (loss, gradient norm, evaluations, "
        "seconds) every so many L-BFGS iterations (0: none).",
        lower_bound=0,
    )
    flags.DEFINE_enum(
        "lbfgs_two_loop",
        sb.two_loop,
        list(sandblaster.TWO_LOOPS),
        "Sandblaster: vector_free: the two-loop recursion on the dot products "
        "of the history (Chen et al. 2014), 2 round trips to the ps per "
        "iteration plus 2 per evaluation; vectors: on the vectors, about "
        "4 * history + 12 round trips.",
    )
    flags.DEFINE_float(
        "portion_stall_timeout_secs",
        sb.stall_timeout_secs,
        "Sandblaster: longest wait, in seconds, for the next work portion to "
        "finish; past it the job fails naming the portions (no worker left).",
    )
    flags.register_validator(
        "portion_stall_timeout_secs",
        lambda secs: math.isfinite(secs) and secs > 0,
        "--portion_stall_timeout_secs must be a finite number of seconds > 0",
    )


def config(values) -> sandblaster.SandblasterConfig:
    """The `SandblasterConfig` the parsed flags `values` (absl `FLAGS`) ask for.

    Raises:
      TypeError, ValueError: see `SandblasterConfig`.
    """
    return sandblaster.SandblasterConfig(
        **{field: values[flag].value for field, flag in FIELDS.items()}
    )
