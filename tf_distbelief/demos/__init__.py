"""Demo models and their data as `ModelSpec`s: `digits` (real), `speech` and
`embedding` (synthetic).

They ship with the package, apart from the library: no module of
tf_distbelief outside `demos` and the launcher (`tf_distbelief.launch`) imports
them. The launcher passes one of them to the training job (`spec(name, ...)`),
as it would a user's spec (`--model=package.module:function`); a program
imports one directly (`from tf_distbelief.demos import digits`).
"""

from __future__ import annotations

import functools
import importlib

# Imports no TensorFlow: the launch script reads the names and the speech
# model's sizes before TensorFlow loads; a model's module is imported when
# its spec builds or loads.
from tf_distbelief import checks
from tf_distbelief.demos import speech
from tf_distbelief.job import spec as spec_lib

# The demo models, each a module `tf_distbelief.demos.<name>`.
MODELS = ("digits", "speech", "embedding")
# Models with a model-parallel version (`tf_distbelief.demos.model_parallel`).
MODEL_PARALLEL = ("digits", "speech")
# Models with a Keras 3 builder, `build_keras3_model` (`--keras=3`).
KERAS3 = ("digits",)

__all__ = [
    "KERAS3",
    "MODELS",
    "MODEL_PARALLEL",
    "module",
    "spec",
]


def module(name: str):
    """The module of demo model `name` (one of `MODELS`), imported."""
    return importlib.import_module(f"{__name__}.{name}")


def _build(name, seed, speech_hidden_units, speech_classes, keras, devices):
    if devices:
        from tf_distbelief.demos import model_parallel

        return model_parallel.build_model(
            name,
            devices,
            seed=seed,
            speech_hidden_units=speech_hidden_units,
            speech_classes=speech_classes,
            keras=keras,
        )
    if keras == 3:
        return module(name).build_keras3_model(seed=seed)
    if name == "speech":
        return speech.build_model(speech_hidden_units, speech_classes, seed=seed)
    return module(name).build_model(seed=seed)


def _load(name, seed, speech_classes):
    if name == "speech":
        return speech.load_data(num_classes=speech_classes, seed=seed)
    return module(name).load_data(seed=seed)


def spec(
    name: str,
    seed: int = 0,
    speech_hidden_units: int = 256,
    speech_classes: int = speech.PAPER_NUM_CLASSES,
    keras: int = 2,
) -> spec_lib.ModelSpec:
    """Returns the `ModelSpec` of demo model `name`.

    Args:
      name: one of `MODELS`.
      seed: initialisation and data seed.
      speech_hidden_units: `speech` only: width of the hidden layers (the
        paper: 2560).
      speech_classes: `speech` only: softmax width (the paper: 8192).
      keras: 2 (tf_keras) or 3: `build_model(None)` returns a built Keras 3
        model, for `tf_distbelief.keras3` (the models in `KERAS3`).

    Returns:
      A `ModelSpec`; `build_model(devices)` gives the model-parallel version
      (one partition per entry of `devices`) for the models in
      `MODEL_PARALLEL`, with Keras 3 too.

    Raises:
      ConfigError: `name` is not one of `MODELS`, or has no Keras 3 builder.
    """
    if name not in MODELS:
        raise checks.argument_error(
            "model", f"one of {', '.join(MODELS)}", name, setting=True
        )
    if keras == 3 and name not in KERAS3:
        raise checks.argument_error(
            "model",
            f"one of {', '.join(KERAS3)} with Keras 3 (`--keras=3`)",
            name,
            setting=True,
        )
    return spec_lib.ModelSpec(
        name=name,
        build_model=functools.partial(
            _build, name, seed, speech_hidden_units, speech_classes, keras
        ),
        load_data=functools.partial(_load, name, seed, speech_classes),
        model_parallel=name in MODEL_PARALLEL,
    )
