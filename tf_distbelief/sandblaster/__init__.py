"""Sandblaster L-BFGS (Dean et al. 2012, section 4.2).

* `lbfgs`: L-BFGS against an abstract `VectorOps` (pure, no TensorFlow).
* `schedule`: work portions and the ledger of their copies (pure).
* `ps_vectors`: `VectorOps` on vectors sharded over the ps tasks.
* `flat_params`: a Keras model's parameters as one flat vector.
* `portion`: the scheduled function that evaluates one work portion.
* `trainer`: `SandblasterObjective` and `SandblasterTrainer`.
"""

from tf_distbelief import _lazy

__all__, __getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "SandblasterObjective": "trainer",
        "SandblasterStats": "trainer",
        "SandblasterTrainer": "trainer",
    },
)
