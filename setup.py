"""Installs tf_distbelief: DistBelief's methods as TensorFlow parts."""

import os
import re

import setuptools


def _version() -> str:
    """`tf_distbelief.__version__`, read from the source (importing the package
    would need its dependencies)."""
    path = os.path.join(os.path.dirname(__file__), "tf_distbelief", "__init__.py")
    with open(path, encoding="utf-8") as f:
        (version,) = re.findall(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    return version


setuptools.setup(
    name="tf_distbelief",
    version=_version(),
    description=(
        "DistBelief (Dean et al., NIPS 2012) on TensorFlow: parameter-server "
        "sharding, Downpour SGD, Sandblaster L-BFGS, model parallelism."
    ),
    packages=setuptools.find_packages(include=["tf_distbelief", "tf_distbelief.*"]),
    python_requires=">=3.10",
    # The training job's command line (`tf_distbelief.launch.train`); in the
    # repository, `python launch/train.py` runs the same code.
    entry_points={
        "console_scripts": ["tf-distbelief-train=tf_distbelief.launch.train:main"]
    },
    install_requires=[
        # The `tensorflow` wheel runs on CPU-only machines and uses a GPU where CUDA
        # is present (`pip install .[gpu]` adds the CUDA libraries). tf-keras itself
        # requires `tensorflow`, so `tensorflow-cpu` would install a second copy.
        "tensorflow>=2.21,<2.22",
        # Keras 2: the Keras that keeps parameter-server `fit` in TF 2.21.
        "tf-keras>=2.21,<2.22",
        # Keras 3 models (`tf_distbelief.keras3`: `stateless_call`, stateless
        # metrics); TensorFlow 2.21 depends on it too.
        "keras>=3.0,<4",
        "numpy>=1.26",
        "absl-py>=2.0",
        # Handwritten digits, shipped inside the package (no download).
        "scikit-learn>=1.3",
        "portpicker>=1.6",
        # `tf.summary` needs it to write TensorBoard scalars; TF 2.21 no longer
        # depends on it.
        "tensorboard>=2.21",
        # `tf_distbelief.cluster.k8s.manifest` writes Kubernetes manifests as YAML
        # (`launch/k8s.py`).
        "pyyaml>=6.0",
    ],
    extras_require={
        "gpu": ["tensorflow[and-cuda]>=2.21,<2.22"],
        # psutil: tests/cluster/test_isolation.py reads the host's listening sockets,
        # tests/cluster/test_gpus.py a task's environment.
        # `kubernetes`: the official client's models check the generated pod
        # templates (tests/cluster/test_k8s.py); no test talks to a cluster. Tested
        # with 37, whose `ApiClient.deserialize` takes the JSON text (older
        # clients take a response object).
        "test": [
            # Below 9.2: pytest 9.2's structured node ids break pytest-xdist's
            # `--dist loadgroup` (pytest-xdist issue 1386, open): the
            # `xdist_group` marks were ignored, so the session fixtures that
            # tests share through them ran once per process (about 2 minutes
            # of CI). tests/conftest.py fails the run if grouping breaks again.
            "pytest>=8,<9.2",
            # README's test command runs the suite in 2 processes (`-n 2`): most
            # tests wait on their clusters' processes, so 2 cores run 2 tests.
            "pytest-xdist>=3.5",
            "scipy>=1.11",
            "ruff>=0.5",
            "psutil>=5.9",
            "kubernetes>=37",
            # The JobSet manifests are validated against the OpenAPI schema of
            # JobSet's CRD (tests/data/, tests/cluster/test_jobset.py).
            "jsonschema>=4.18",
            # tests/bench/test_bench_plots.py draws the benchmarks' figures.
            "matplotlib>=3.8",
        ],
        # benchmarks/: figures (matplotlib, Agg backend), the tasks' environments
        # (psutil, faults_bench.py), SciPy's L-BFGS-B (sandblaster_bench.py).
        "bench": ["matplotlib>=3.8", "psutil>=5.9", "scipy>=1.11"],
        # The documentation site (mkdocs.yml, docs/), built by CI with --strict.
        "docs": [
            # The site generator; 1.6 for the hook's `File.generated` pages.
            "mkdocs>=1.6,<2",
            # The theme, and pymdown-extensions (snippets, admonitions) with it.
            "mkdocs-material>=9.5,<10",
            # The API reference from docstrings (static griffe analysis, no
            # TensorFlow import).
            "mkdocstrings[python]>=1.0,<2",
        ],
    },
)
