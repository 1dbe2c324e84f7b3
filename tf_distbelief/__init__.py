"""tf_distbelief: DistBelief (Dean et al., NIPS 2012) as TensorFlow parts.

Each public name has one import path. This namespace holds the strategy, the
fit layer's public names and every error (all subclass `DistBeliefError`);
each algorithm and the cluster keep their names in their own package:

* `cluster`: `TF_CONFIG`, validation, ps/worker servers, `LocalCluster`.
* `DistBeliefStrategy`: a ParameterServerStrategy with variables sharded over
  the ps tasks by a partitioner (`strategy.make_partitioner`).
* `adagrad`: AdaGrad applied on the ps shards (section 4.1).
* `downpour`: Downpour SGD (section 4.1).
* `sandblaster`: Sandblaster L-BFGS (section 4.2).
* `model_parallel`: one replica split across devices (section 3).
* `keras3`: Keras 3 models on the same ps and strategy (`keras3.fit`).
* `fit`: `fit.fit`, tf_keras `Model.fit` with progress, checkpoints, exact
  resume, exact validation (`fit.ExactValidation`), per-worker training files
  (`fit.FileInput`) and export; `job`: the training job `launch/train.py` runs.
* `planner`: predicted examples/s and bottleneck of stock and Downpour
  training from bytes per step and NIC rates (no TensorFlow).
* `console`: the lines a job prints, and `console.quiet()`, which silences
  TensorFlow's C++ and gRPC logging.
* `faults`: exactly-once steps, the non-finite guard, exact restore, ps
  recovery and the bounded wait for steps, under the algorithms.

Apart from the library, which never imports them: `demos`, the demo models
as `ModelSpec`s, and `launch`, the `tf-distbelief-train` command.

Names are imported on first use, so that the pure modules (schedules, NumPy
references, L-BFGS and partition math) import without TensorFlow.
"""

from tf_distbelief import _lazy

# The package's version: setup.py reads it from this line.
__version__ = "0.1.0"

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "AddressError": "cluster.addresses",
        "ArgumentError": "checks",
        "CheckpointWriteError": "faults.resume",
        "ClusterConfigError": "cluster.config",
        "ClusterConnectError": "cluster.connect",
        "ClusterStartError": "cluster.config",
        "ConfigError": "errors",
        "DistBeliefError": "errors",
        "DistBeliefStrategy": "strategy",
        "DownpourUnsupportedError": "downpour.variables",
        "EmulatedNetworkError": "cluster.network.emulated",
        "FitHooks": "hooks",
        "GpuAssignmentError": "cluster.local.gpus",
        "InfiniteValidationDataError": "fit.validation",
        "Keras3Error": "strategy",
        "NonFiniteError": "errors",
        "ModelDirInUseError": "paths",
        "PsLostError": "faults.recovery",
        "RestoreError": "faults.resume",
        "RowSparseReadError": "downpour.variables",
        "StepStallError": "faults.step_watch",
    },
    packages=(
        "adagrad",
        "cluster",
        "console",
        "downpour",
        "faults",
        "fit",
        "job",
        "keras3",
        "model_parallel",
        "planner",
        "sandblaster",
    ),
)
