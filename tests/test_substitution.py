"""`tf_distbelief.substitution`: one way to read variables as other tensors."""

import numpy as np
import pytest
import tensorflow as tf

from tf_distbelief import substitution


class _Rows(substitution.RowSource):
    """Rows `10 * index`, of width 2; records the indices asked for."""

    def __init__(self):
        self.asked = []

    def read_rows(self, indices):
        self.asked.append(indices.numpy().tolist())
        rows = tf.cast(tf.reshape(indices, [-1, 1]), tf.float64) * 10.0
        return tf.reshape(tf.tile(rows, [1, 2]), [*indices.shape, 2])


def test_plain_variables_read_as_their_tensors_inside_the_blocks():
    w = tf.Variable(np.ones((3, 2)), name="w")
    value = tf.constant(np.arange(6.0).reshape(3, 2))
    with substitution.substitutable([w]), substitution.substitute([(w, value)]):
        assert isinstance(w, substitution.Substitutable)
        for read in (
            tf.convert_to_tensor(w),
            w.value(),
            w.read_value(),
            w + 0.0,
        ):
            np.testing.assert_array_equal(read, value)
        np.testing.assert_array_equal(w.sparse_read([2, 0]), value.numpy()[[2, 0]])
        np.testing.assert_array_equal(w.gather_nd([[1, 1]]), [3.0])
        with pytest.raises(ValueError, match=r"Variable w.*float64.*as float32"):
            w._dense_var_to_tensor(dtype=tf.float32)
    assert type(w) is not substitution.Substitutable
    assert not isinstance(w, substitution.Substitutable)
    np.testing.assert_array_equal(tf.convert_to_tensor(w), np.ones((3, 2)))


def test_gradient_flows_to_the_substituted_tensor_in_a_traced_function():
    w = tf.Variable(np.ones(3), name="w")

    @tf.function
    def gradient(value):
        with tf.GradientTape() as tape:
            tape.watch(value)
            with substitution.substitutable([w]):
                with substitution.substitute([(w, value)]):
                    loss = tf.reduce_sum(w * w)
        return tape.gradient(loss, value)

    value = tf.constant([1.0, 2.0, 3.0], tf.float64)
    np.testing.assert_array_equal(gradient(value), [2.0, 4.0, 6.0])
    assert not gradient.get_concrete_function(value).captured_inputs  # No `w`.


def test_a_row_source_serves_lookups_and_refuses_whole_reads():
    table = tf.Variable(np.zeros((5, 2)), name="table")
    rows = _Rows()
    with substitution.substitutable([table]), substitution.substitute([(table, rows)]):
        looked_up = tf.nn.embedding_lookup(table, tf.constant([[4, 1]]))
        np.testing.assert_array_equal(looked_up, [[[40.0, 40.0], [10.0, 10.0]]])
        assert rows.asked == [[[4, 1]]]
        with pytest.raises(RuntimeError, match=r"table.*reads by rows only"):
            tf.convert_to_tensor(table)


def test_nested_blocks_restore_the_outer_substitution():
    w = tf.Variable(np.zeros(2), name="w")
    outer, inner = (
        tf.constant([1.0, 1.0], tf.float64),
        tf.constant([2.0, 2.0], tf.float64),
    )
    with substitution.substitutable([w]):
        with substitution.substitute([(w, outer)]):
            with substitution.substitutable([w]), substitution.substitute([(w, inner)]):
                np.testing.assert_array_equal(w.value(), inner)
            np.testing.assert_array_equal(w.value(), outer)
            assert isinstance(w, substitution.Substitutable)
        np.testing.assert_array_equal(w.value(), [0.0, 0.0])
