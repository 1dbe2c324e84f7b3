"""Keras 3 models (TensorFlow backend) trained on the ps, without tf_keras.

Keras 3 has no parameter-server training, and its `Model.fit` cannot run
through a `ClusterCoordinator` (README: Keras 3). This package trains a Keras 3
model with the same cluster, `DistBeliefStrategy`, ps sharding and AdaGrad as
the tf_keras path:

* `variables`: `PsWeights`, a ps variable (sharded by the strategy's
  partitioner) for each weight of the model, with AdaGrad accumulators on the
  same shards; the trained values go back into the model's own variables.
* `optimizer`: `Adagrad` and `SGD` (with momentum), the optimizers applied on
  the ps shards by fused ops (no tf_keras); a `keras.optimizers.SGD` maps to
  `SGD`.
* `training`: `fit(model, x, y, ...)`, stock asynchronous training: each step
  is a function scheduled on a worker (`step`, or `downpour` with Downpour)
  that calls `model.stateless_call` on the ps values. Keras 3 callbacks and a
  `keras.callbacks.History`. Its parts: `training_args` (the arguments'
  record and checks), `training_setup` (what a run trains with),
  `training_loop` (the epochs).
* `checkpoints`: `fit(model_dir=...)`'s checkpoints, in the tf_keras job's
  layout and written, restored and verified by the same `faults` services
  (exact resume into any number of ps tasks).
* `layers`: `PartitionedDense` and `PartitionedLocallyConnected2D`, the
  model-parallel layers (section 3) as Keras 3 layers.
* `job`: the training job of `launch/train.py --keras=3` (ps recovery and
  export as for tf_keras).
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "Adagrad": "optimizer",
        "PartitionedDense": "layers",
        "PartitionedLocallyConnected2D": "layers",
        "PsWeights": "variables",
        "SGD": "optimizer",
        "fit": "training",
    },
)
