"""The fault layer's settings that a job chooses, without TensorFlow.

`job.JobConfig` and the launch script's flags are checked before TensorFlow
loads (a typo'd flag is answered at once); the modules that apply these
settings (`nonfinite`, `step_watch`, `recovery`) import TensorFlow.
"""

from __future__ import annotations

from tf_distbelief import checks

# What a step (Downpour: a push) with a NaN or inf gradient does; it is never
# applied: `raise` stops the job naming the step, `skip` skips and counts it.
NONFINITE_MODES = ("raise", "skip")
# Longer than a local task's restart (4-5 s) and a Kubernetes pod's reschedule
# (an image pull: minutes); as long as Sandblaster's portion wait.
DEFAULT_STEP_STALL_TIMEOUT_SECS = 600.0
# A real cluster's orchestrator reschedules a pod in seconds to minutes (an
# image pull, a node drain); a local task restarts in 4-5 s.
DEFAULT_PS_RECOVERY_SECS = 300.0


def check_nonfinite_mode(mode: str) -> str:
    """Returns `mode` if it is one of `NONFINITE_MODES`.

    Raises:
      checks.ArgumentError: naming the argument, the allowed values and the
        value.
    """
    checks.check_one_of("nonfinite", mode, NONFINITE_MODES)
    return mode


# Kubernetes gives a pod 30 s between SIGTERM and SIGKILL by default
# (`terminationGracePeriodSeconds`); the save at the signal ends before that.
DEFAULT_PREEMPTION_GRACE_SECS = 25.0
# Signals a scheduler may send before it stops a job, besides SIGTERM (which
# always saves): Slurm's `--signal=USR1@60`, for instance.
PREEMPTION_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")
