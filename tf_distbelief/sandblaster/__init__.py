"""Sandblaster L-BFGS (Dean et al. 2012, section 4.2).

* `lbfgs`: L-BFGS (two-loop recursion, driver) against an abstract `VectorOps`
  (pure, no TensorFlow).
* `lbfgs_state`: `LbfgsState`, what L-BFGS carries between iterations and
  resumes from (pure).
* `two_loop`: the two-loop recursion on vectors or vector-free (pure).
* `vector_ops`: the `VectorOps` interface and its NumPy backend (pure).
* `line_search`: the strong Wolfe line search (pure).
* `config`: `SandblasterConfig`, the settings of a run (pure).
* `schedule`: work portions and the ledger of their copies (pure).
* `ps_vectors`: `VectorOps` on vectors sharded over the ps tasks.
* `ps_batched`: its batched operations (vector-free L-BFGS).
* `flat_params`: a Keras model's parameters as one flat vector.
* `portion`: the scheduled function that evaluates one work portion.
* `objective`: `SandblasterObjective`, the objective evaluated in portions.
* `trainer`: `SandblasterTrainer`, L-BFGS on the cluster for a Keras model.
* `checkpoint`: `LbfgsCheckpointer`, the L-BFGS state in checkpoints (resume).
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "SandblasterConfig": "config",
        "SandblasterObjective": "objective",
        "SandblasterStats": "schedule",
        "SandblasterTrainer": "trainer",
        "TWO_LOOPS": "two_loop",
    },
)
