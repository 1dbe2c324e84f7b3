"""Model-parallel replicas (Dean et al. 2012, section 3) of `speech` and `digits`.

Each model takes and gives what its one-device counterpart does, so the data,
loss and metrics of `tf_distbelief.demos.speech` and
`tf_distbelief.demos.digits` apply unchanged. Each is built with tf_keras
(`keras=2`, the tf_distbelief.model_parallel layers, under the strategy's
scope) or with Keras 3 (`keras=3`, the tf_distbelief.keras3.layers layers,
outside it, for `tf_distbelief.keras3.fit`):

* `speech`: the paper's fully connected acoustic model (440 inputs, 4 sigmoid
  hidden layers, softmax logits) with every layer's units split over the devices
  (`PartitionedDense`). Fully connected layers split worst: each partition needs
  the whole input of each layer.
* `digits`: a locally connected image model. The `[batch, 64]` digits are reshaped
  to `8 x 8 x 1` images, a `PartitionedLocallyConnected2D` layer (output rows split
  into blocks, one per device) reads them, and a dense softmax head classifies.
  Locally connected layers split best: only a thin halo crosses partitions.

`devices` are names without job or task, e.g. `["/device:CPU:0", "/device:CPU:1"]`
(`tf_distbelief.model_parallel.cpu_device_names(2)`): inside a function that
`ClusterCoordinator.schedule` runs on a worker they resolve to that worker's own
devices. The worker servers must expose them (`LocalCluster(...,
cpu_devices_per_worker=2)`, `cluster.server_config(cpu_devices=2)`); otherwise the
ops silently run on `CPU:0` (a worker's server exposes only the devices its
`ConfigProto` gives it). Variables still live on
the ps tasks, created by the strategy as usual.

```python
from tf_distbelief.demos import model_parallel
from tf_distbelief.model_parallel import devices as mp

with strategy.scope():
    model = model_parallel.build_model("digits", mp.cpu_device_names(2), seed=0)
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tf_distbelief import checks
from tf_distbelief.demos import digits, speech

MODEL_NAMES = ("digits", "speech")
IMAGE_SHAPE = (8, 8, 1)  # The digits' 64 pixels as rows, columns, channels.


class _Layers(NamedTuple):
    keras: Any  # `tf_keras` or `keras`.
    dense: type  # Its `PartitionedDense`.
    locally_connected: type  # Its `PartitionedLocallyConnected2D`.


def _layers(keras: int) -> _Layers:
    """The Keras module and partitioned layers of Keras `keras` (2 or 3)."""
    if keras == 3:
        import keras as keras3

        from tf_distbelief.keras3 import layers

        return _Layers(
            keras3, layers.PartitionedDense, layers.PartitionedLocallyConnected2D
        )
    if keras != 2:
        raise checks.argument_error("keras", "2 or 3", keras)
    import tf_keras

    from tf_distbelief.model_parallel import dense, locally_connected

    return _Layers(
        tf_keras,
        dense.PartitionedDense,
        locally_connected.PartitionedLocallyConnected2D,
    )


def _check_partitions(num_partitions: int | None, devices: Sequence[str]) -> int:
    if not devices:
        raise ValueError(
            "Argument `devices` must name at least one device, e.g. "
            f"['/device:CPU:0', '/device:CPU:1']. Received: {list(devices)!r}"
        )
    if num_partitions is None:
        return len(devices)
    if not isinstance(num_partitions, int) or num_partitions < 1:
        raise checks.argument_error(
            "num_partitions",
            "a positive integer or None (one partition per device)",
            num_partitions,
        )
    return num_partitions


def build_speech_mlp(
    devices: Sequence[str],
    num_partitions: int | None = None,
    hidden_units: int = 256,
    num_classes: int = speech.PAPER_NUM_CLASSES,
    seed: int = 0,
    keras: int = 2,
):
    """Returns the uncompiled speech MLP with each layer's units split.

    Same shapes and initializer seeds as
    `tf_distbelief.demos.speech.build_model`: 440 inputs, 4 x `hidden_units`
    sigmoid, `num_classes` logits; every layer (the softmax layer too) is a
    `PartitionedDense` over `num_partitions` devices.

    Args:
      devices: device names; partition `k` runs on `devices[k % len(devices)]`.
      num_partitions: partitions per layer; `None` means `len(devices)`. At most
        `hidden_units` and `num_classes`.
      hidden_units: width of each hidden layer (2560 in the paper).
      num_classes: softmax width (8192 in the paper).
      seed: initializer seed.
      keras: 2 (tf_keras) or 3 (Keras 3).

    Returns:
      A `Sequential` of that Keras mapping `[batch, 440]` float32 to
      `[batch, num_classes]` logits.

    Raises:
      ValueError: if an argument is out of range.
    """
    num_partitions = _check_partitions(num_partitions, devices)
    speech.check_positive(hidden_units=hidden_units, num_classes=num_classes)
    api = _layers(keras)
    init = api.keras.initializers.GlorotUniform
    layers = [api.keras.Input(shape=(speech.NUM_FEATURES,))]
    for i in range(speech.NUM_HIDDEN_LAYERS):
        layers.append(
            api.dense(
                hidden_units,
                num_partitions,
                devices,
                activation="sigmoid",
                kernel_initializer=init(seed + i),
                name=f"hidden_{i}",
            )
        )
    layers.append(
        api.dense(
            num_classes,
            num_partitions,
            devices,
            kernel_initializer=init(seed + 99),
            name="logits",
        )
    )
    return api.keras.Sequential(layers, name="speech_mlp_partitioned")


def build_digits_lc(
    devices: Sequence[str],
    num_partitions: int | None = None,
    filters: int = 16,
    kernel_size: int = 3,
    seed: int = 0,
    keras: int = 2,
):
    """Returns an uncompiled locally connected digits classifier, split spatially.

    `[batch, 64]` -> `8 x 8 x 1` -> `PartitionedLocallyConnected2D(filters,
    kernel_size)` (relu; its `9 - kernel_size` output rows split into
    `num_partitions` blocks) -> flatten -> dense 10 logits (on the replica's
    default device).

    Args:
      devices: device names; block `k` runs on `devices[k % len(devices)]`.
      num_partitions: row blocks; `None` means `len(devices)`. At most the output
        rows, `9 - kernel_size`.
      filters: output channels per position of the locally connected layer.
      kernel_size: window rows and columns, 1 to 8.
      seed: initializer seed.
      keras: 2 (tf_keras) or 3 (Keras 3).

    Returns:
      A `Sequential` of that Keras mapping `[batch, 64]` float32 to `[batch, 10]`
      logits, like `tf_distbelief.demos.digits.build_model`.

    Raises:
      ValueError: if an argument is out of range (some at build time).
    """
    num_partitions = _check_partitions(num_partitions, devices)
    api = _layers(keras)
    init = api.keras.initializers.GlorotUniform
    return api.keras.Sequential(
        [
            api.keras.Input(shape=(digits.NUM_FEATURES,)),
            api.keras.layers.Reshape(IMAGE_SHAPE),
            api.locally_connected(
                filters,
                kernel_size,
                num_partitions=num_partitions,
                devices=devices,
                activation="relu",
                kernel_initializer=init(seed),
                name="local",
            ),
            api.keras.layers.Flatten(),
            api.keras.layers.Dense(
                digits.NUM_CLASSES, kernel_initializer=init(seed + 1), name="logits"
            ),
        ],
        name="digits_lc_partitioned",
    )


def build_model(
    name: str,
    devices: Sequence[str],
    seed: int = 0,
    num_partitions: int | None = None,
    speech_hidden_units: int = 256,
    speech_classes: int = speech.PAPER_NUM_CLASSES,
    keras: int = 2,
):
    """Returns the uncompiled model-parallel replica of model `name`.

    The entry point for `--devices_per_replica=k`: call it with
    `devices=tf_distbelief.model_parallel.cpu_device_names(k)`, under the
    strategy's scope for tf_keras, outside it (once the strategy has
    connected, so that the workers' devices are known) for Keras 3.

    Args:
      name: `"digits"` (`build_digits_lc`) or `"speech"` (`build_speech_mlp`).
      devices: device names of one replica, e.g. `["/device:CPU:0",
        "/device:CPU:1"]`.
      seed: initializer seed.
      num_partitions: partitions per layer; `None` means `len(devices)`.
      speech_hidden_units: `speech` only: width of the hidden layers.
      speech_classes: `speech` only: softmax width.
      keras: 2 (tf_keras) or 3 (Keras 3).

    Returns:
      A model of that Keras with the inputs and outputs of
      `tf_distbelief.demos.<name>.build_model`.

    Raises:
      ValueError: if `name` has no model-parallel version, or an argument is out
        of range.
    """
    if name == "digits":
        return build_digits_lc(devices, num_partitions, seed=seed, keras=keras)
    if name == "speech":
        return build_speech_mlp(
            devices,
            num_partitions,
            hidden_units=speech_hidden_units,
            num_classes=speech_classes,
            seed=seed,
            keras=keras,
        )
    raise checks.argument_error(
        "name",
        f"one of {', '.join(MODEL_NAMES)} (models with a model-parallel version)",
        name,
    )
