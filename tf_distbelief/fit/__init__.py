"""The fit layer: a tf_keras model's training job above the algorithms.

`training.fit` (tf_keras `Model.fit` with checkpoints, exact resume and the
non-finite guard), `progress` (progress lines and TensorBoard scalars),
`lines` (the progress lines' format, Keras 3's too), `follower` (the
finished steps, read while the workers run),
`validation` (exact validation on the coordinator), `evaluation` (each
checkpoint evaluated as it appears), `export` (SavedModel and `.keras`) and
`data` (training files, each worker its own).

This layer imports no algorithm package (`downpour`, `sandblaster`,
`model_parallel`): an algorithm reaches it through the `hooks.FitHooks` that
its `install` attaches to the model.
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "ExactValidation": "validation",
        "ExportPaths": "export",
        "FileInput": "data",
        "FitResult": "training",
        "Progress": "progress",
        "accuracy": "training",
        "dataset_creator": "training",
        "export_checkpoint": "export",
        "export_model": "export",
        "fit": "training",
    },
)
