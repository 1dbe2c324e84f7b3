"""The training job that `launch/train.py` runs.

* `config`: `JobConfig`, the job's settings (it holds a `DownpourConfig`).
* `spec`: `ModelSpec`, the model and its data; `load_spec` imports a user's
  spec named `package.module:function`.
* `runner`: `run` (dispatch on the task type, for any `Trainer`: `TF_KERAS`
  or `keras3.job.TRAINER`), `connect_strategy`, `train`, `compile_model`,
  `evaluate_checkpoints`, `main`.
"""

from tf_distbelief.job.config import OPTIMIZERS, JobConfig
from tf_distbelief.job.runner import (
    TF_KERAS,
    Trainer,
    build_model,
    build_optimizer,
    check_spec,
    compile_model,
    connect_strategy,
    evaluate_checkpoints,
    main,
    run,
    train,
)
from tf_distbelief.job.spec import ModelSpec, load_spec

__all__ = [
    "OPTIMIZERS",
    "JobConfig",
    "ModelSpec",
    "TF_KERAS",
    "Trainer",
    "build_model",
    "build_optimizer",
    "check_spec",
    "compile_model",
    "connect_strategy",
    "evaluate_checkpoints",
    "load_spec",
    "main",
    "run",
    "train",
]
