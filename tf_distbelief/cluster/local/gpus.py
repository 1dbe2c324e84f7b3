"""Which GPUs each task of a local cluster sees: a pure function, no TensorFlow.

On a host with several GPUs every process sees every GPU, and TensorFlow
reserves nearly all the memory of each GPU it sees the first time it uses one:
the first worker to start would take every GPU and the others would fail or
crawl. `LocalCluster` therefore gives each task its own `CUDA_VISIBLE_DEVICES`
(the CUDA driver's own per-process device list, read when CUDA initialises) and
`TF_FORCE_GPU_ALLOW_GROWTH=true` (TensorFlow's switch for allocating GPU memory
as it is used).

The rule (`assign_gpus`), with `G` GPUs visible to the chief and `W` workers:

* `gpus_per_worker=None` (the default): if `G >= W`, each worker gets its own
  `G // W` GPUs, in blocks (worker 0 the first `G // W`); the `G % W` left over
  stay unused (`ParameterServerStrategy` needs the same GPU count on every
  worker). If `0 < G < W`, each worker gets one GPU, shared round-robin
  (worker `i` gets GPU `i % G`), which memory growth makes possible. If
  `G == 0`, nothing is set: the tasks inherit the chief's environment.
* `gpus_per_worker=k > 0`: each worker gets its own `k`; `k * W > G` is an
  error (`GpuAssignmentError`), since a user who names a count expects it
  exclusively.
* `gpus_per_worker=0`: every task sees no GPU (a CPU-only run on a GPU host).

ps tasks never see a GPU: they hold variables and apply updates, which
`ParameterServerStrategy` places on their CPU; a visible GPU would only take
memory. The chief (the calling process) keeps the GPUs it sees, with memory
growth: it runs the user's program and evaluates the model.

With `--devices_per_replica=d` (model parallelism, section 3) a replica is split
over its worker's GPUs when every worker has at least `d`
(`model_parallel.worker_device_names`); `gpus_per_worker` unset gives each
worker `G // W`, so `G >= d * W` GPUs split every replica over GPUs.

How many GPUs the chief sees, without importing TensorFlow
(`visible_gpus`): its own `CUDA_VISIBLE_DEVICES` when set, else the GPUs that
`nvidia-smi -L` lists, else none.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from tf_distbelief import checks, errors

# The CUDA_VISIBLE_DEVICES value that hides every GPU from a process.
NO_GPU = ""
_NVIDIA_SMI_TIMEOUT_SECS = 20.0
_NVIDIA_SMI_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)


class GpuAssignmentError(errors.ConfigError):
    """`gpus_per_worker` asks for more GPUs than the host has."""


def parse_cuda_visible_devices(value: str) -> list[str]:
    """The device ids in a `CUDA_VISIBLE_DEVICES` value, in its order.

    CUDA reads the comma-separated list up to the first invalid entry; `-1` (or
    any negative index) is the usual way to hide every device. Ids are kept as
    written (indices such as `"2"`, or UUIDs such as `"GPU-8f6c..."`), so that a
    child given a subset names the same physical devices.

    Args:
      value: the variable's value, e.g. `"0,1"`, `""`, `"-1"`.

    Returns:
      The ids, e.g. `["0", "1"]`; `[]` for no device.
    """
    ids = []
    for item in value.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        ids.append(item)
    return ids


def parse_nvidia_smi(text: str) -> list[str]:
    """The GPU indices in `nvidia-smi -L` output (`GPU 0: NVIDIA H100 ...`)."""
    return _NVIDIA_SMI_LINE.findall(text)


def _nvidia_smi_list() -> str:
    """`nvidia-smi -L`'s output, or "" where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "-L"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_SECS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def visible_gpus(
    environ: Mapping[str, str] | None = None, nvidia_smi_output: str | None = None
) -> list[str]:
    """The GPU ids this process may use, found without importing TensorFlow.

    Args:
      environ: the environment (default `os.environ`); its
        `CUDA_VISIBLE_DEVICES`, when set, is the answer.
      nvidia_smi_output: `nvidia-smi -L` output to use instead of running it
        (tests inject it).

    Returns:
      Device ids for children's `CUDA_VISIBLE_DEVICES`: the parent's own ids,
      or `"0"..."G-1"` from `nvidia-smi`; `[]` on a host without GPUs.
    """
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return parse_cuda_visible_devices(environ["CUDA_VISIBLE_DEVICES"])
    if nvidia_smi_output is None:
        nvidia_smi_output = _nvidia_smi_list()
    return parse_nvidia_smi(nvidia_smi_output)


def assign_gpus(
    gpus: Sequence[str],
    num_workers: int,
    num_ps: int,
    gpus_per_worker: int | None = None,
) -> dict[tuple[str, int], str]:
    """Each worker's and ps task's `CUDA_VISIBLE_DEVICES`; see the module docstring.

    Args:
      gpus: the GPU ids the chief sees (`visible_gpus()`).
      num_workers: worker tasks, >= 1.
      num_ps: ps tasks, >= 1.
      gpus_per_worker: GPUs of each worker; None for `len(gpus) // num_workers`
        (one shared GPU each when there are fewer GPUs than workers); 0 for
        none.

    Returns:
      `{("worker", i): "0,1", ..., ("ps", j): ""}`; `{}` (nothing to set)
      when no GPU is visible and `gpus_per_worker` is None.

    Raises:
      GpuAssignmentError: `gpus_per_worker * num_workers` exceeds `len(gpus)`.
      ValueError: `gpus_per_worker` is negative or not an integer.
    """
    checks.check_optional_int(
        "gpus_per_worker",
        gpus_per_worker,
        0,
        "None (share the host's GPUs among the workers) or an integer >= 0",
    )
    gpus = list(gpus)
    if gpus_per_worker is None and not gpus:
        return {}
    ps = {("ps", j): NO_GPU for j in range(num_ps)}
    if gpus_per_worker is None:
        if len(gpus) < num_workers:
            workers = {("worker", i): gpus[i % len(gpus)] for i in range(num_workers)}
            return {**workers, **ps}
        gpus_per_worker = len(gpus) // num_workers
    needed = gpus_per_worker * num_workers
    if needed > len(gpus):
        most = len(gpus) // num_workers
        raise GpuAssignmentError(
            f"Argument `gpus_per_worker` asks for {gpus_per_worker} GPUs for each "
            f"of {num_workers} workers ({needed} in all), but this host shows "
            f"{len(gpus)} ({', '.join(gpus) or 'none'}: CUDA_VISIBLE_DEVICES or "
            f"`nvidia-smi -L`). Use 0..{most}, fewer workers, or leave it unset "
            "to share the GPUs among the workers."
        )
    workers = {
        ("worker", i): ",".join(gpus[i * gpus_per_worker : (i + 1) * gpus_per_worker])
        for i in range(num_workers)
    }
    return {**workers, **ps}


def task_env(
    assignment: Mapping[tuple[str, int], str],
    job: str,
    index: int,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment variables one task gets on top of the chief's.

    Args:
      assignment: `assign_gpus`'s result.
      job, index: the task.
      environ: the chief's environment (default `os.environ`); a
        `TF_FORCE_GPU_ALLOW_GROWTH` the user set there is kept.

    Returns:
      `{}` when the task is not in `assignment`; else its
      `CUDA_VISIBLE_DEVICES` and, when it sees a GPU,
      `TF_FORCE_GPU_ALLOW_GROWTH`.
    """
    environ = os.environ if environ is None else environ
    if (job, index) not in assignment:
        return {}
    env = {"CUDA_VISIBLE_DEVICES": assignment[(job, index)]}
    if env["CUDA_VISIBLE_DEVICES"]:
        env["TF_FORCE_GPU_ALLOW_GROWTH"] = environ.get(
            "TF_FORCE_GPU_ALLOW_GROWTH", "true"
        )
    return env
