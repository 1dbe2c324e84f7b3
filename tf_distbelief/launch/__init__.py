"""The command line of the training job: `tf-distbelief-train` (`train.main`).

Apart from the library, like `tf_distbelief.demos`: no module of tf_distbelief
outside this package imports it.
"""
