"""Trains a model on a DistBelief cluster: the `tf-distbelief-train` command.

Local cluster (no `TF_CONFIG`): the command starts `--num_workers` workers and
`--num_ps` ps tasks on 127.0.0.1, trains, prints test accuracy, and ends them;
on Linux it first re-executes itself in a private network namespace
(`--isolate_network`), since TensorFlow's servers listen on every interface.
With `TF_CONFIG` the same command runs on every machine; each task does its part
(ps/worker serve, chief trains, evaluator evaluates checkpoints).

  tf-distbelief-train --model=digits --optimizer=adagrad --num_workers=2 --num_ps=2

`main` is the entry point of the installed command, of `python -m
tf_distbelief.launch.train` and of the repository's `launch/train.py`.
"""

import dataclasses
import math
import os
import sys

# None of these imports TensorFlow: the flags are parsed, and `--help` or a
# bad value answered, before it loads (in `_run`).
from absl import app, flags, logging

from tf_distbelief import console, demos, downpour, errors, job, partitioning
from tf_distbelief.cluster import source as cluster_source
from tf_distbelief.cluster.network import emulated, isolation
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour.push_rules import rule as push_rule
from tf_distbelief.faults import settings as fault_settings
from tf_distbelief.launch import sandblaster_flags

FLAGS = flags.FLAGS

# Flags that only Downpour reads, one per `DownpourConfig` field and push rule
# setting (`DownpourConfig.setting_names`): given without --downpour they would
# be ignored, even at their default values.
_DOWNPOUR_FLAGS = downpour.DownpourConfig.setting_names()


def define_flags() -> None:
    """Defines the flags; all optional, defaults from the job's dataclasses."""
    d = job.JobConfig()
    dp = downpour.DownpourConfig()
    flags.DEFINE_string(
        "model",
        "digits",
        f"Model and data to train: a demo model ({', '.join(demos.MODELS)}) or "
        "a user's ModelSpec, `package.module:function`.",
    )
    flags.register_validator(
        "model",
        lambda value: value in demos.MODELS or ":" in value,
        message=f"value should be one of {', '.join(demos.MODELS)}, or a spec "
        "`package.module:function`",
    )
    flags.DEFINE_enum(
        "keras",
        "2",
        ["2", "3"],
        "2: a tf_keras model, tf_keras Model.fit (`tf.keras` is tf_keras: "
        "TF_USE_LEGACY_KERAS=1 unless set); 3: a Keras 3 model "
        "(`import keras`), trained by tf_distbelief.keras3.fit (README: Keras 3).",
    )
    flags.DEFINE_enum(
        "optimizer",
        d.optimizer,
        job.OPTIMIZERS,
        "adagrad: AdaGrad on the ps shards (paper section 4.1); sgd: plain SGD; "
        "lbfgs: Sandblaster L-BFGS (section 4.2, full batch).",
    )
    flags.DEFINE_float(
        "learning_rate", d.learning_rate, "Step size (gamma).", lower_bound=1e-12
    )
    flags.DEFINE_float(
        "initial_accumulator_value",
        d.initial_accumulator_value,
        "AdaGrad's initial accumulator.",
        lower_bound=0.0,
    )
    flags.DEFINE_float("epsilon", d.epsilon, "AdaGrad's epsilon.", lower_bound=0.0)
    flags.DEFINE_float(
        "staleness_power",
        d.staleness_power,
        "AdaGrad without Downpour (tf_keras): a gradient tau updates stale is "
        "applied with step learning_rate / max(1, tau)^power; 0 turns it off. "
        "The default damps 8 and 16 workers' updates (tau about 7 and 15) and "
        "leaves 1 and 2 workers' (tau 0 or 1) alone (docs: More workers).",
        lower_bound=0.0,
    )
    flags.DEFINE_integer(
        "batch_size", d.batch_size, "Examples per step per worker.", lower_bound=1
    )
    flags.DEFINE_integer(
        "epochs",
        d.epochs,
        "Epoch to train to (a resumed run continues).",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "steps_per_epoch",
        d.steps_per_epoch,
        "Steps per epoch over all workers.",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "steps_per_execution",
        d.steps_per_execution,
        "Steps per scheduled function.",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "num_workers",
        d.num_workers,
        "Workers of the local cluster (no TF_CONFIG).",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "num_ps",
        d.num_ps,
        "ps tasks of the local cluster (no TF_CONFIG).",
        lower_bound=1,
    )
    flags.DEFINE_enum(
        "partitioner",
        d.partitioner,
        partitioning.PARTITIONERS,
        "min_size / max_size: shards of --shard_bytes, at most one per ps; "
        "fixed: one shard per ps.",
    )
    flags.DEFINE_integer(
        "shard_bytes",
        d.shard_bytes,
        "Shard size in bytes for min_size/max_size.",
        lower_bound=1,
    )
    flags.DEFINE_string("model_dir", None, "Checkpoints (resume) and TensorBoard logs.")
    flags.DEFINE_string(
        "export_dir",
        d.export_dir,
        "At the end of training the chief writes a SavedModel (serving_default) "
        "and a .keras file here (new, empty, or an earlier export, replaced).",
    )
    flags.DEFINE_integer(
        "checkpoint_every_steps",
        d.checkpoint_every_steps,
        "Write a checkpoint every so many steps as well as at each epoch end "
        "(0: epoch ends only); a rerun with the same --model_dir resumes at "
        "the last one. Needs --model_dir.",
        lower_bound=0,
    )
    flags.DEFINE_enum(
        "nonfinite",
        d.nonfinite,
        fault_settings.NONFINITE_MODES,
        "A step (with --downpour, a push) whose gradients hold NaN or inf is "
        "never applied to the ps: raise stops the job naming the step; skip "
        "skips it and counts it.",
    )
    flags.register_multi_flags_validator(
        ["checkpoint_every_steps", "model_dir"],
        lambda v: not v["checkpoint_every_steps"] or bool(v["model_dir"]),
        message="--checkpoint_every_steps needs --model_dir (where checkpoints go).",
    )
    flags.DEFINE_integer(
        "log_every_steps",
        d.log_every_steps,
        "Progress line every so many steps (0: per epoch).",
        lower_bound=0,
    )
    flags.DEFINE_integer(
        "speech_hidden_units",
        256,
        "Speech model hidden width (paper: 2560).",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "speech_classes",
        demos.speech.PAPER_NUM_CLASSES,
        "Speech model softmax width (paper: 8192).",
        lower_bound=2,
    )
    flags.DEFINE_integer("seed", d.seed, "Initialisation and data seed.")
    flags.DEFINE_bool(
        isolation.FLAG_NAME,
        True,
        "Local cluster (no TF_CONFIG): run the job in a private network namespace "
        "(Linux user + network namespaces), so that TensorFlow's servers, which "
        "listen on every interface and run any op sent to them, are unreachable "
        "from the network. Off or unavailable: a warning names the open ports.",
    )
    flags.DEFINE_string(
        "emulate_nic",
        d.emulate_nic,
        "Local cluster only: an emulated network, each ps and worker task in a "
        "network namespace of its own behind a NIC of this rate in and out "
        "(1gbit, 100mbit, 10gbit, ...; a veth shaped by tc htb, inside the "
        "job's private network namespace; no added latency). Unset: loopback "
        "as is.",
    )
    flags.DEFINE_string(
        "emulate_ps_nic",
        d.emulate_ps_nic,
        "With --emulate_nic: the ps tasks' NIC rate (default: --emulate_nic's).",
    )
    flags.DEFINE_enum(
        "cluster_from",
        d.cluster_from,
        list(cluster_source.CLUSTER_SOURCES),
        "auto: TF_CONFIG when set, else the pod's JobSet identity when its "
        "environment is there (launch/k8s.py --kind=jobset), else the local "
        "cluster; tf_config: TF_CONFIG or the local cluster; jobset: TF_CONFIG "
        "built from the pod's JobSet identity (TFDB_JOBSET_* variables).",
    )
    flags.DEFINE_float(
        "chief_gone_secs",
        d.chief_gone_secs,
        "ps/worker tasks (TF_CONFIG) exit once the chief has been gone this many "
        "seconds; unset: serve until SIGTERM.",
        lower_bound=0.0,
    )
    flags.DEFINE_float(
        "connect_timeout_secs",
        d.connect_timeout_secs,
        "The chief fails, naming them, when ps or worker tasks do not answer "
        "as TensorFlow servers within this many seconds.",
        lower_bound=1e-3,
    )
    flags.DEFINE_float(
        "hung_task_timeout_secs",
        d.hung_task_timeout_secs,
        "A ps or worker task that accepts connections but has not answered a "
        "status probe for this many seconds is hung and treated as lost: the "
        "local cluster kills and restarts it (its step in flight runs again "
        "elsewhere); with TF_CONFIG the chief names it and leaves it to the "
        "orchestrator.",
        lower_bound=1e-3,
    )
    flags.DEFINE_float(
        "step_stall_timeout_secs",
        d.step_stall_timeout_secs,
        "The chief fails, naming the workers not accepting connections, when "
        "scheduled steps wait this many seconds with none finishing.",
        lower_bound=1e-3,
    )
    flags.DEFINE_float(
        "ps_recovery_secs",
        d.ps_recovery_secs,
        "A ps task lost during training is waited for this many seconds to "
        "serve again (the local cluster restarts it), then every ps value is "
        "restored from the last checkpoint in --model_dir and training goes "
        "on; 0: no recovery. Needs --model_dir and a checkpoint "
        "(--checkpoint_every_steps).",
        lower_bound=0.0,
    )
    flags.DEFINE_float(
        "preemption_grace_secs",
        d.preemption_grace_secs,
        "On SIGTERM (or --preemption_signal) the chief saves the step reached "
        "to --model_dir and exits within this many seconds; a save that "
        "cannot finish in time is abandoned whole (the previous checkpoint "
        "stays the latest). 0: exit at once, unsaved. Below Kubernetes' "
        "default terminationGracePeriodSeconds (30).",
        lower_bound=0.0,
    )
    flags.DEFINE_enum(
        "preemption_signal",
        d.preemption_signal,
        list(fault_settings.PREEMPTION_SIGNALS),
        "One more signal than SIGTERM that saves and stops the job as SIGTERM "
        "does (Slurm's --signal=USR1@60 sends SIGUSR1).",
    )
    flags.DEFINE_bool(
        "downpour",
        False,
        "Downpour SGD (paper section 4.1): each worker keeps a parameter cache, "
        "fetches every --n_fetch steps and pushes every --n_push steps.",
    )
    flags.DEFINE_integer(
        "n_fetch", dp.n_fetch, "Downpour: steps between fetches.", lower_bound=1
    )
    flags.DEFINE_integer(
        "n_push", dp.n_push, "Downpour: steps between pushes.", lower_bound=1
    )
    flags.DEFINE_enum(
        "local_optimizer",
        dp.local_optimizer,
        downpour_config.LOCAL_OPTIMIZERS,
        "Downpour: each worker's update of its cache: AdaGrad with the worker's "
        "own accumulator, or SGD.",
    )
    flags.DEFINE_float(
        "local_learning_rate",
        dp.local_learning_rate,
        "Downpour: step size of each worker's update of its cache (unset: "
        "--learning_rate for adagrad, 0.5 for sgd; 0: none, which at a large "
        "--n_push fails to train: see README).",
        lower_bound=0.0,
    )
    flags.DEFINE_enum(
        "adagrad_accumulator",
        dp.adagrad_accumulator,
        downpour_config.ADAGRAD_ACCUMULATORS,
        "Downpour with AdaGrad: a push grows the ps accumulator by the pushed "
        "steps' squared gradients (squares: sent along, twice the push bytes), "
        "by G^2/n_push (mean) or by G^2 (sum).",
    )
    flags.DEFINE_integer(
        "warmstart_steps",
        dp.warmstart_steps,
        "Downpour: steps worker 0 trains alone first.",
        lower_bound=0,
    )
    flags.DEFINE_integer(
        "max_staleness",
        dp.max_staleness,
        "Downpour: drop pushes staler than this many ps updates (unset: apply all).",
        lower_bound=0,
    )
    # The push rules' settings, from their registry (`push_rules.rule`).
    define = {
        "float": flags.DEFINE_float,
        "int": flags.DEFINE_integer,
        "bool": flags.DEFINE_bool,
    }
    for setting in push_rule.settings():
        bounds = {}
        if setting.kind in ("float", "int"):
            bounds = {"lower_bound": setting.lower_bound}
            bounds["upper_bound"] = setting.upper_bound
        define[setting.kind](
            setting.name, getattr(dp, setting.name), setting.help, **bounds
        )

    # Downpour's rules across flags (--downpour given, `DownpourConfig`'s
    # checks) are `job_config`'s: an absl validator over these flags would
    # print every one of them before its message.

    sandblaster_flags.define_flags()
    flags.adopt_module_key_flags(sandblaster_flags)  # Listed by --help.
    flags.DEFINE_integer(
        "devices_per_replica",
        d.devices_per_replica,
        "Model parallelism (section 3): split each replica over this many devices "
        "of its worker (digits: partitioned locally connected model; speech: "
        "partitioned dense layers, tf_keras only).",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "gpus_per_worker",
        d.gpus_per_worker,
        "Local cluster on a GPU host: GPUs each worker sees (ps tasks none); "
        "unset: the host's GPUs shared evenly (one shared GPU each when there "
        "are fewer GPUs than workers); 0: CPUs only.",
        lower_bound=0,
    )
    # absl's bounds let NaN through, and an upper bound is not set: a NaN or
    # infinite value would fail late (NaN) or train to chance (epsilon=inf).
    for name in _FLOAT_FLAGS:
        flags.register_validator(
            name,
            lambda value: value is None or math.isfinite(value),
            message=f"--{name} must be a finite number.",
        )
    for name in ("emulate_nic", "emulate_ps_nic"):
        flags.register_validator(
            name,
            lambda value: value is None or _is_rate(value),
            message=f"--{name} must be a rate such as 1gbit, 100mbit or 10gbit "
            "(units bit, kbit, mbit, gbit, tbit), between 10kbit and 1tbit.",
        )


def _is_rate(value: str) -> bool:
    try:
        emulated.parse_rate(value)
    except ValueError:
        return False
    return True


_FLOAT_FLAGS = (
    "learning_rate",
    "initial_accumulator_value",
    "epsilon",
    "staleness_power",
    "chief_gone_secs",
    "connect_timeout_secs",
    "hung_task_timeout_secs",
    "step_stall_timeout_secs",
    "ps_recovery_secs",
    "preemption_grace_secs",
    "local_learning_rate",
    *(s.name for s in push_rule.settings() if s.kind == "float"),
)
# `SandblasterConfig` field -> its flag.


def model_spec():
    """The `ModelSpec` `--model` names: a demo model, or a user's spec."""
    if FLAGS.model in demos.MODELS:
        return demos.spec(
            FLAGS.model,
            seed=FLAGS.seed,
            speech_hidden_units=FLAGS.speech_hidden_units,
            speech_classes=FLAGS.speech_classes,
            keras=int(FLAGS.keras),
        )
    return job.load_spec(FLAGS.model)


def job_config(argv) -> job.JobConfig:
    """The job the parsed flags describe, validated; no TensorFlow.

    Args:
      argv: what `absl.app.run` passes on: the program and no other argument.

    Returns:
      The validated `JobConfig` (`JobConfig.validate`).

    Raises:
      app.UsageError: a positional argument, Downpour settings without
        `--downpour`, Downpour settings `DownpourConfig` refuses (its
        message, naming the flags), or a push rule's setting without the
        rule (`--top_k_chunk` without `--top_k_fraction`).
      errors.ConfigError: a refused setting (one line on the console).
    """
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    given = [f"--{name}" for name in _DOWNPOUR_FLAGS if FLAGS[name].present]
    if given and not FLAGS.downpour:
        raise app.UsageError(
            f"{', '.join(given)}: Downpour settings, ignored without --downpour: "
            "add --downpour."
        )
    nested = {"downpour", "sandblaster"}
    fields = {f.name for f in dataclasses.fields(job.JobConfig)} - nested
    config = job.JobConfig(
        **{name: FLAGS[name].value for name in fields},
        sandblaster=sandblaster_flags.config(FLAGS),
    )
    if FLAGS.downpour:
        try:
            config.downpour = downpour.DownpourConfig(
                **{name: FLAGS[name].value for name in _DOWNPOUR_FLAGS}
            )
        except (TypeError, ValueError) as e:
            raise app.UsageError(f"Downpour settings: {_as_flags(e)}") from e
        _refuse_idle_rule_settings(config.downpour)
    return config.validate()


def _refuse_idle_rule_settings(config) -> None:
    """Refuses a push rule's other settings given while the rule is off
    (`--top_k_chunk` without `--top_k_fraction`): they would be ignored.

    Raises:
      app.UsageError: naming each such flag and the rule's own flag.
    """
    idle = [
        f"--{s.name} is a setting of --{r.name} and does nothing without it: "
        f"add --{r.name} or drop --{s.name}"
        for r in push_rule.rules()
        if not r.is_on(config)
        for s in r.settings
        if s.name != r.name and FLAGS[s.name].present
    ]
    if idle:
        raise app.UsageError("; ".join(idle) + ".")


def _as_flags(error: Exception) -> str:
    """`DownpourConfig`'s message, its fields named as the flags the user wrote."""
    message = str(error)
    for name in _DOWNPOUR_FLAGS:
        message = message.replace(f"Argument `{name}`", f"`{name}`")
        message = message.replace(f"`{name}`", f"`--{name}`")
    return message.replace("Arguments `--", "`--")


def _run(argv):
    config = job_config(argv)
    if not FLAGS["verbosity"].present:
        # absl turns an unset --verbosity into INFO; TensorFlow's INFO logs
        # would bury the progress lines.
        logging.set_verbosity(logging.WARNING)
    # Loading TensorFlow takes seconds (tens on a loaded machine): say so first.
    console.echo(
        console.starting_line(
            sys.argv, os.environ, console.LOCAL_NUM_WORKERS, console.LOCAL_NUM_PS
        )
    )
    from tf_distbelief.job import stopping  # Imports no TensorFlow.

    if FLAGS.keras == "2":
        # A tf_keras job: `import tensorflow` then binds `tf.keras` to tf_keras,
        # which the job imports anyway, instead of importing Keras 3 (with
        # scikit-learn and SciPy), which it never uses: 1.4 s of CPU less on
        # every start (of 4.8 s for TensorFlow and tf_keras), as a ps or
        # worker task does (`cluster.server_main`). A value set already wins.
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    with stopping.while_loading():
        console.import_tensorflow_quietly()
    spec = model_spec()
    if FLAGS.keras == "3":
        from tf_distbelief.keras3 import job as keras3_job

        job.main(config, spec, trainer=keras3_job.TRAINER)
    else:
        job.main(config, spec)


def main() -> None:
    """Runs the command: `sys.argv` holds its flags.

    First thing, with nothing of TensorFlow loaded and no thread started, the
    local job re-executes itself in a private network namespace
    (`isolation.enter_private_network`: the same interpreter and command line,
    `sys.orig_argv`, which also re-runs an installed console script); then
    the flags are parsed, and `--help` or a bad value answered, before
    TensorFlow loads.
    """
    # Keep TensorFlow's C++ INFO/WARNING lines out of the progress.
    console.quiet_environment()
    # The local job's TensorFlow servers listen on every interface: re-execute
    # in a private network namespace (README: Security) while no TensorFlow is
    # loaded and no thread runs; returns where isolation is off or unavailable.
    isolation.enter_private_network(isolation.flag_value(sys.argv))
    # A pipe (docker, Kubernetes, `| tee`) shows each line as it is written.
    sys.stdout.reconfigure(line_buffering=True)
    define_flags()
    # `--help` lists the key flags of the program being run (absl: of the
    # module named `sys.argv[0]`), and prints `__main__`'s docstring as usage;
    # an installed console script's `__main__` is a wrapper without either.
    for flag in FLAGS.get_key_flags_for_module(__name__):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    program = sys.modules["__main__"]
    if not program.__doc__:
        program.__doc__ = __doc__
    app.run(console.refusals_in_one_line(_run, (app.UsageError, errors.ConfigError)))


if __name__ == "__main__":
    main()
