"""Export for serving: a trained model, every sharded variable joined whole.

Under `DistBeliefStrategy` a model's large variables are `ShardedVariable`s on
the ps tasks: `model.save` then writes one weight per shard (a Keras file that
plain Keras cannot load) or a SavedModel that needs the cluster alive. Here the
model's weights go through a TensorFlow checkpoint, which stores a sharded
variable whole (the same route that lets a `model_dir` resume into another
number of ps), into a plain copy of the model built outside any strategy; the
copy is saved twice:

* `<export_dir>/saved_model`: a TensorFlow SavedModel with a
  `serving_default` signature. Loads with `tf.saved_model.load` (or
  `tf_keras.models.load_model`) in any process, with no cluster, no
  `TF_CONFIG` and no tf_distbelief import; TensorFlow Serving serves it.
* `<export_dir>/model.keras`: the Keras file of the same model, for
  `tf_keras.models.load_model` (a model with tf_distbelief's partitioned
  layers needs `import tf_distbelief.model_parallel` first).

A Keras 3 model (`keras3.fit`) lives on the chief with its trained weights:
`export_keras3_model` writes the same two files from it.

`export_checkpoint` does the same from a `model_dir` checkpoint with no cluster
running at all, so a finished or crashed job can still be exported.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable

import tensorflow as tf
import tf_keras

from tf_distbelief import checks, console, errors, paths


@dataclasses.dataclass(frozen=True)
class ExportPaths:
    """Where `export_model` wrote the model.

    Attributes:
      saved_model: the SavedModel directory (`serving_default` signature).
      keras_file: the `.keras` file.
      refused: why the `export_dir` asked for could not be written (the
        export went to a new temporary folder instead, so that a trained
        model is never lost), or None.
    """

    saved_model: str
    keras_file: str
    refused: str | None = None

    def line(self, export_dir: str) -> str:
        """The one console line that says where the export went."""
        if self.refused is None:
            return f"exported: {self.saved_model} {self.keras_file}"
        return (
            f"export_dir {export_dir!r} could not be written ({self.refused}); "
            f"exported to {os.path.dirname(self.saved_model)} instead: "
            f"{self.saved_model} {self.keras_file}"
        )


def _check_no_strategy() -> None:
    if tf.distribute.has_strategy():
        raise RuntimeError(
            "Export builds a plain copy of the model: call it outside "
            "`strategy.scope()`."
        )


def _plain_copy(build_model: Callable[[], tf_keras.Model], input_shape=None):
    """`build_model()` outside any strategy's scope, its variables created
    (built with `input_shape` when `build_model` gives an unbuilt model).

    Raises:
      RuntimeError: called inside a strategy's scope.
      ValueError: the model is not built and no `input_shape` is known.
    """
    _check_no_strategy()
    plain = build_model()
    if not plain.built and input_shape is not None:
        plain.build(input_shape)
    if not plain.built:
        raise ValueError(
            f"The model {plain.name!r} that `build_model` returns is not built, "
            "so it cannot be exported: give it an input layer, or pass "
            "`input_shape`."
        )
    return plain


def _restore_into(plain: tf_keras.Model, checkpoint_path: str) -> None:
    """Restores the `model` of a checkpoint into `plain`, every weight matched.

    Raises:
      ValueError: naming the checkpoint when a weight of `plain` is not in it
        or does not fit (never a silent partial restore).
    """
    status = tf.train.Checkpoint(model=plain).restore(checkpoint_path)
    try:
        status.expect_partial()  # The optimizer and counters are not exported.
        status.assert_existing_objects_matched()
    except AssertionError as e:
        raise ValueError(
            f"The checkpoint {checkpoint_path} does not hold every weight of the "
            f"model to export ({console.shorten(str(e), 500)})."
        ) from None


def check_export_dir(export_dir: str, model_dir: str | None = None) -> None:
    """Checks, before any cluster starts, that `export_dir` can take an export.

    Allowed: a new path, an empty directory, or a directory holding only an
    earlier export (`saved_model/` with its `saved_model.pb`, `model.keras`),
    which the new export replaces. Anything else there is a user's file: the
    export is refused rather than mixed in, and nothing is deleted.

    Args:
      export_dir: where the export will go.
      model_dir: the job's `model_dir`, which `export_dir` must not be.

    Raises:
      ConfigError: naming `export_dir`, the rule and the fix.
    """
    path = os.path.abspath(export_dir)
    if model_dir and path == os.path.abspath(model_dir):
        raise errors.ConfigError(
            "`export_dir` must not be the `model_dir` (checkpoints and logs): "
            f"choose another directory, e.g. {os.path.join(path, 'export')!r}. "
            f"Received: {export_dir!r}"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise checks.argument_error(
            "export_dir", "a directory", export_dir, "(a file)", setting=True
        )
    if os.path.isdir(path):
        others = sorted(
            set(os.listdir(path)) - {paths.SAVED_MODEL_SUBDIR, paths.KERAS_FILE}
        )
        saved = os.path.join(path, paths.SAVED_MODEL_SUBDIR)
        if os.path.isdir(saved) and not os.path.isfile(
            os.path.join(saved, "saved_model.pb")
        ):
            others.insert(0, f"{paths.SAVED_MODEL_SUBDIR}/ (not a SavedModel)")
        if others:
            raise checks.argument_error(
                "export_dir",
                "new, empty, or hold only an earlier export "
                f"({paths.SAVED_MODEL_SUBDIR}/, {paths.KERAS_FILE})",
                export_dir,
                fix=f"It also holds {', '.join(others[:5])}"
                f"{' ...' if len(others) > 5 else ''}. "
                "Choose another directory (nothing was deleted).",
                setting=True,
            )
    paths.check_parent_writable("export_dir", export_dir, "written")


def _serving_signature(plain: tf_keras.Model, input_spec: tf.TensorSpec):
    """`serving_default` taking `input_spec` (the training data's dtype and shape).

    tf_keras derives a model's own signature from its input layer, float32
    unless the model declares another: a model of int64 ids (an `Embedding`
    fed by `Sequential`'s inferred input) would be served float32 ids.
    """

    def serve(inputs):
        outputs = plain(inputs, training=False)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return dict(zip(plain.output_names, outputs))

    return tf.function(serve, input_signature=[input_spec], autograph=False)


def _save(
    plain: tf_keras.Model, export_dir: str, input_spec: tf.TensorSpec | None = None
) -> ExportPaths:
    """Saves both formats of a plain tf_keras model (`_write_export`)."""

    def write(saved_model: str, keras_file: str) -> None:
        plain.save(
            saved_model,
            save_format="tf",
            include_optimizer=False,
            signatures=None
            if input_spec is None
            else {"serving_default": _serving_signature(plain, input_spec)},
        )
        plain.save(keras_file)  # It has no optimizer.

    return _write_export(export_dir, write)


def _write_export(export_dir: str, write: Callable[[str, str], None]) -> ExportPaths:
    """`write(saved_model, keras_file)` into `export_dir`, or where it can.

    The export runs after training, and `export_dir` was checked before any
    server started (`paths.probe_writable`), but a disk can fill or a mount
    go read-only meanwhile: then the model is written to a new temporary
    folder, named in `ExportPaths.refused`'s line, rather than lost.
    """
    try:
        return _write_export_to(export_dir, write)
    except OSError as e:
        fallback = tempfile.mkdtemp(prefix="tf_distbelief_export_")
        written = _write_export_to(fallback, write)
        return dataclasses.replace(written, refused=e.strerror or str(e))


def _write_export_to(export_dir: str, write: Callable[[str, str], None]) -> ExportPaths:
    """`write(saved_model, keras_file)` into a new folder, then moves both into
    place: an earlier export is replaced whole, never torn or mixed."""
    os.makedirs(export_dir, exist_ok=True)
    written = ExportPaths(
        saved_model=os.path.join(export_dir, paths.SAVED_MODEL_SUBDIR),
        keras_file=os.path.join(export_dir, paths.KERAS_FILE),
    )
    with tempfile.TemporaryDirectory(prefix=".export-", dir=export_dir) as tmp:
        write(
            os.path.join(tmp, paths.SAVED_MODEL_SUBDIR),
            os.path.join(tmp, paths.KERAS_FILE),
        )
        if os.path.isdir(written.saved_model):
            shutil.rmtree(written.saved_model)
        os.replace(os.path.join(tmp, paths.SAVED_MODEL_SUBDIR), written.saved_model)
        os.replace(os.path.join(tmp, paths.KERAS_FILE), written.keras_file)
    return written


def export_keras3_model(
    model, export_dir: str, input_spec: tf.TensorSpec | None = None
) -> ExportPaths:
    """Exports a Keras 3 model that lives on this process, both formats.

    For a model trained with `keras3.fit`, whose trained weights are written
    back into it: `<export_dir>/saved_model` (Keras 3's `model.export`, a
    TensorFlow SavedModel with a `serving_default` signature, loadable with
    `tf.saved_model.load` in any process, no Keras needed) and
    `<export_dir>/model.keras` (`keras.models.load_model`).

    Args:
      model: a built Keras 3 model (TensorFlow backend).
      export_dir: where to write; created if needed.
      input_spec: what `serving_default` takes, e.g.
        `tf.TensorSpec([None, 64], tf.float32)`; None: the model's inputs.

    Returns:
      The `ExportPaths` written.
    """

    def write(saved_model: str, keras_file: str) -> None:
        model.export(
            saved_model,
            format="tf_saved_model",
            input_signature=None if input_spec is None else [input_spec],
            verbose=False,
        )
        model.save(keras_file)

    return _write_export(export_dir, write)


def export_model(
    model: tf_keras.Model,
    build_model: Callable[[], tf_keras.Model],
    export_dir: str,
    input_spec: tf.TensorSpec | None = None,
) -> ExportPaths:
    """Exports a model trained under `DistBeliefStrategy` for serving.

    Call it on the chief, outside `strategy.scope()`, while the cluster runs:
    the ps values are read once, into a TensorFlow checkpoint (sharded
    variables whole), restored into `build_model()`, and saved.

    Args:
      model: the trained model (variables on the ps, sharded or not).
      build_model: `() -> tf_keras.Model`, a built model of the same
        architecture (the `ModelSpec`'s builder); called with no strategy.
      export_dir: where to write; created if needed. Files already there
        with other names are left alone.
      input_spec: what `serving_default` takes, e.g.
        `tf.TensorSpec([None, 20], tf.int64)` for a batch of 20 int64 ids
        (the training data's dtype and shape, batch dimension None); None:
        tf_keras's own signature, from the model's input layer.

    Returns:
      The `ExportPaths` written.

    Raises:
      ValueError: the plain model's weights do not all match the model's.
      RuntimeError: called inside a strategy's scope.
    """
    _check_no_strategy()
    with tempfile.TemporaryDirectory(prefix="tfdb_export_") as tmp:
        path = tf.train.Checkpoint(model=model).save(os.path.join(tmp, "model"))
        plain = _plain_copy(build_model, getattr(model, "input_shape", None))
        _restore_into(plain, path)
    return _save(plain, export_dir, input_spec)


def export_checkpoint(
    checkpoint: str,
    build_model: Callable[[], tf_keras.Model],
    export_dir: str,
    input_shape=None,
) -> ExportPaths:
    """Exports the model of a `model_dir` checkpoint, with no cluster at all.

    Args:
      checkpoint: a checkpoint path (`.../checkpoints/ckpt-5`), a checkpoint
        directory, or a `model_dir` (its latest checkpoint is used).
      build_model: `() -> tf_keras.Model`, a built model of the same
        architecture.
      export_dir: where to write.
      input_shape: the input shape to build the model with when `build_model`
        gives an unbuilt model, e.g. `(None, 64)`.

    Returns:
      The `ExportPaths` written.

    Raises:
      FileNotFoundError: no checkpoint at `checkpoint`.
      ValueError: the checkpoint does not hold every weight of the model.
    """
    _check_no_strategy()
    path = checkpoint
    for folder in (checkpoint, paths.checkpoint_dir(checkpoint)):
        if os.path.isdir(folder):
            latest = tf.train.latest_checkpoint(folder)
            if latest:
                path = latest
                break
    if not tf.io.gfile.exists(path + ".index"):
        raise FileNotFoundError(
            f"No checkpoint at {checkpoint!r} (give a checkpoint path such as "
            "model_dir/checkpoints/ckpt-5, its directory, or the model_dir)."
        )
    plain = _plain_copy(build_model, input_shape)
    _restore_into(plain, path)
    return _save(plain, export_dir)
