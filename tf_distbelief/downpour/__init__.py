"""Downpour SGD (Dean et al. 2012, section 4.1).

* `config`, `schedule`: the configuration and the step order, with the cadence
  rules and a NumPy reference (`schedule.simulate`); pure, no TensorFlow.
* `update_stream`, `position_codes`: compressed outer pushes with
  update-stream fetches, and the bytes of coded positions, in NumPy (the
  ways of compressing the exchange, compared before any is built); pure.
* `variables`: ps variables that read as a replica's cache (`enable`).
* `base`, `dense`, `row_sparse`: a replica's per-worker state and ops, per
  variable kind (dense variables, tables read by rows).
* `push_rules`: the push rules on the ps, one module each (outer Nesterov,
  delay compensation, staleness-scaled step), with their registry (`rule`),
  NumPy side (`reference`) and TF side (`on_ps`).
* `replica`: `Downpour`, the replica's step on the cluster.
* `replica_state`: `ReplicaState`, each replica's own state in checkpoints.
* `keras`: `install` on a compiled tf_keras model, `DownpourTrainer`,
  `DownpourMetrics`.
* `report`: the figures in words for the console (the epoch's, the run's).
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "Downpour": "replica",
        "DownpourConfig": "config",
        "DownpourMetrics": "keras",
        "DownpourTrainer": "keras",
        "ReplicaState": "replica_state",
        "ReplicaStats": "schedule",
        "embedding_tables": "keras",
        "enable": "variables",
        "install": "keras",
    },
)
