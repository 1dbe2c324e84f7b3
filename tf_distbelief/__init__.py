"""tf_distbelief: DistBelief (Dean et al., NIPS 2012) as TensorFlow parts.

The public surface; the subpackages hold the details (import modules, not
names). Names are imported on first use, so that the pure modules (schedules,
NumPy references, L-BFGS and partition math) import without TensorFlow.

* `cluster`: `TF_CONFIG`, validation, ps/worker servers, `LocalCluster`.
* `strategy`: `DistBeliefStrategy`, a ParameterServerStrategy with variables
  sharded over the ps tasks by a partitioner; `step_watch` bounds the wait of
  its scheduled steps (`StepStallError`).
* `adagrad`: AdaGrad applied on the ps shards (section 4.1).
* `downpour`: Downpour SGD (section 4.1).
* `sandblaster`: Sandblaster L-BFGS (section 4.2).
* `model_parallel`: one replica split across devices (section 3).
* `keras3`: Keras 3 models on the same ps and strategy (`keras3.fit`).
* `training`, `job`: `Model.fit` with progress, checkpoints and resume; the
  training job that `launch/train.py` runs.
* `data`, `validation`, `export`: training data from files, each worker its
  own; exact validation on the coordinator; export for serving.
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "Adagrad": "adagrad.optimizer",
        "ClusterConfigError": "cluster.config",
        "ClusterStartError": "cluster.config",
        "ConfigError": "errors",
        "DistBeliefStrategy": "strategy",
        "Downpour": "downpour.replica",
        "DownpourConfig": "downpour.config",
        "DownpourMetrics": "downpour.keras",
        "DownpourTrainer": "downpour.keras",
        "ExactValidation": "fit.validation",
        "FileInput": "fit.data",
        "Keras3Error": "strategy",
        "LocalCluster": "cluster.local",
        "SandblasterConfig": "sandblaster.config",
        "SandblasterObjective": "sandblaster.objective",
        "SandblasterStats": "sandblaster.objective",
        "SandblasterTrainer": "sandblaster.trainer",
        "StepStallError": "faults.step_watch",
        "resolve_cluster": "cluster.config",
    },
)
