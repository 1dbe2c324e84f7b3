"""Downpour SGD (Dean et al. 2012, section 4.1).

* `config`, `schedule`: the configuration and the step order, with a NumPy
  reference (`schedule.simulate`); pure, no TensorFlow.
* `variables`: ps variables that read as a replica's cache (`enable`).
* `replica`: `Downpour`, the per-replica state and step on the cluster.
* `keras`: `install` on a compiled tf_keras model, `DownpourTrainer`,
  `DownpourMetrics`.
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "Downpour": "replica",
        "DownpourConfig": "schedule",
        "DownpourMetrics": "replica",
        "DownpourTrainer": "replica",
        "ReplicaStats": "schedule",
        "RowSparseReadError": "variables",
        "embedding_tables": "replica",
        "enable": "variables",
        "install": "replica",
    },
)
