"""The training job that `launch/train.py` runs.

* `config`: `JobConfig`, the job's settings (it holds a `DownpourConfig`).
* `spec`: `ModelSpec`, the model and its data; `load_spec` imports a user's
  spec named `package.module:function`.
* `runner`: `run` (dispatch on the task type, for any `Trainer`: `TF_KERAS`
  or `keras3.job.TRAINER`), `connect_strategy`, `train`, `compile_model`,
  `evaluate_checkpoints`, `main`.
"""

from tf_distbelief import _lazy

# Imported on first use: `config` and `spec` load without TensorFlow, so that
# the launch script parses its flags before TensorFlow loads.
__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "OPTIMIZERS": "config",
        "JobConfig": "config",
        "TF_KERAS": "runner",
        "Trainer": "runner",
        "build_model": "runner",
        "build_optimizer": "runner",
        "check_spec": "runner",
        "compile_model": "runner",
        "connect_strategy": "runner",
        "evaluate_checkpoints": "runner",
        "main": "runner",
        "run": "runner",
        "train": "runner",
        "ModelSpec": "spec",
        "load_spec": "spec",
    },
)
