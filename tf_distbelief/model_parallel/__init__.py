"""Model parallelism: one model replica split across devices (Dean et al.
2012, section 3).

* `devices`: a replica's devices and explicit placement (`call_on_device`).
* `partition_math`: partition bounds, which inputs each partition reads, and the
  bytes that cross partitions (pure, no TensorFlow).
* `base`: `PartitionedWeights`, the per-partition weight blocks and their
  conversion to and from the unpartitioned layer's weights.
* `dense_partitions`, `local_partitions`: the partitioned layers' computation,
  shared by the tf_keras layers and the Keras 3 ones (`tf_distbelief.keras3.layers`).
* `blocks`: activation maps held as a grid of blocks (scatter, gather, halo
  exchange).
* `dense`, `locally_connected`: the partitioned tf_keras layers.
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "PartitionedDense": "dense",
        "PartitionedWeights": "base",
        "PartitionedLocallyConnected2D": "locally_connected",
        "assign_devices": "devices",
        "call_on_device": "devices",
        "configure_logical_cpus": "devices",
        "cpu_device_names": "devices",
        "replica_devices": "devices",
        "worker_device_names": "devices",
    },
)
