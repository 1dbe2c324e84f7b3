"""AdaGrad applied on the parameter-server shards (Dean et al. 2012, section 4.1).

* `rule`: the update as a pure NumPy function (no TensorFlow).
* `ops`: the fused op on resource handles (TensorFlow, no tf_keras).
* `optimizer`: `Adagrad`, the tf_keras optimizer whose accumulators and update
  ops live on the ps shards of their variables.
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__, {"Adagrad": "optimizer", "adagrad_update": "rule"}
)
