"""Entry point of a ps or worker task: `python -m tf_distbelief.cluster.server_main`.

The task reads its role from `TF_CONFIG` (see `tf_distbelief.cluster`) and serves
until SIGTERM. The launch script dispatches here too when `TF_CONFIG` names a ps
or worker task.
"""

import os

from absl import app, flags

if __name__ == "__main__":
    # Where the task's TensorFlow is imported whole (`tf_internals.server_runtime`
    # finds a plugin to load), `import tensorflow` then binds `tf.keras` to
    # tf_keras (`TF_USE_LEGACY_KERAS`) instead of importing Keras 3, which
    # brings scikit-learn and SciPy along: a ps or worker task builds no model.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from tf_distbelief.cluster import config, server, source  # noqa: E402

_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 1, "CPU devices the server exposes.", lower_bound=1
)
_CHIEF_GONE_SECS = flags.DEFINE_float(
    "chief_gone_secs",
    None,
    "Exit once the chief has stopped listening for this many seconds "
    "(unset: serve until SIGTERM).",
    lower_bound=0.0,
)
_READY_FILE = flags.DEFINE_string(
    "ready_file", None, "A file written once the server listens."
)


def main(argv):
    del argv
    task = source.resolve_task()
    if task is None:
        raise config.ClusterConfigError(
            "A ps or worker task reads its cluster from `TF_CONFIG` (or a "
            "JobSet's environment); neither is set."
        )
    # TensorFlow's runtime without its Python API: this process runs nothing
    # but the server (`tf_internals.server_runtime`).
    server.serve_task(
        task,
        cpu_devices=_CPU_DEVICES.value,
        chief_gone_secs=_CHIEF_GONE_SECS.value,
        ready_file=_READY_FILE.value,
        lean=True,
    )


if __name__ == "__main__":
    app.run(main)
