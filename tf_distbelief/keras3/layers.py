"""Model-parallel Keras 3 layers: one replica's layer split over devices.

Dean et al. 2012, section 3, for Keras 3 models: `PartitionedDense` (output
units split) and `PartitionedLocallyConnected2D` (output map split into
spatial blocks; only the halo crosses). They compute what their tf_keras
namesakes in `tf_distbelief.model_parallel` compute (the same
`dense_partitions` and `local_partitions` code), with Keras 3 activations and
initializers. Each partition's forward and backward ops run under its device
(`model_parallel.devices.call_on_device`), also inside `model.stateless_call`,
so a Keras 3 model trained by `keras3.fit` runs each partition on its device
of the worker (`LocalCluster(..., cpu_devices_per_worker=k)` or k GPUs per
worker) while its weights live on the ps.

```python
import keras
from tf_distbelief.keras3 import layers
from tf_distbelief.model_parallel import devices as model_parallel

model_parallel.configure_logical_cpus(2)  # Before TensorFlow initialises.
model = keras.Sequential([
    keras.Input((440,)),
    layers.PartitionedDense(256, 2, activation="sigmoid"),
    layers.PartitionedDense(10, 2),
])
```

Both are registered Keras serializables (package `tf_distbelief`): a saved
`model.keras` loads with `keras.models.load_model` once this module is
imported, in a process that has the devices the layers name. Neither runs
under XLA: a model holding one compiles with `jit_compile=False` whatever
`compile` is given.
"""

from __future__ import annotations

import keras

from tf_distbelief.model_parallel import dense_partitions, local_partitions

__all__ = ["PartitionedDense", "PartitionedLocallyConnected2D"]


def _tuple_shape(dims):
    # Keras 3 takes shapes as tuples (a `tf.TensorShape` is not one).
    return tuple(dims)


class _OnSeveralDevices:
    """Mixin: a Keras 3 layer whose ops run on several devices, without XLA.

    XLA compiles a function for one device, and a partition's variables on
    another cannot be read from it (`model.compile(jit_compile=True)` failed
    in `fit` with "Trying to access resource ... located in device CPU:1 from
    device CPU:0"). `supports_jit = False` makes Keras 3 resolve
    `jit_compile="auto"` (XLA on a GPU host) and `True` to no XLA.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.supports_jit = False


@keras.saving.register_keras_serializable(package="tf_distbelief")
class PartitionedDense(
    _OnSeveralDevices, dense_partitions.DensePartitions, keras.layers.Layer
):
    """`keras.layers.Dense` with its units split over devices (Keras 3).

    See `tf_distbelief.model_parallel.dense_partitions.DensePartitions` for
    the arguments and the computation: partition `k` owns units
    `bounds[k]:bounds[k + 1]`, its kernel `[input_units, its_units]` and bias
    `[its_units]` are made under its device and its matrix product runs
    there. Results equal `keras.layers.Dense` with the same weights
    (`set_unpartitioned_weights` takes `Dense.get_weights()`).
    """

    _keras = keras
    _shape = staticmethod(_tuple_shape)


@keras.saving.register_keras_serializable(package="tf_distbelief")
class PartitionedLocallyConnected2D(
    _OnSeveralDevices, local_partitions.LocallyConnectedPartitions, keras.layers.Layer
):
    """A locally connected 2D layer split spatially over devices (Keras 3).

    Keras 3 has no `LocallyConnected2D`; this computes exactly what
    `tf_keras.layers.LocallyConnected2D` (`padding="valid"`,
    `implementation=1` weights, `channels_last`) computes, and takes and gives
    weights in its layout. See
    `tf_distbelief.model_parallel.local_partitions.LocallyConnectedPartitions`
    for the arguments, the whole and block layouts (`output_blocks=True`
    keeps a stack of them partitioned) and the computation.
    """

    _keras = keras
    _shape = staticmethod(_tuple_shape)
