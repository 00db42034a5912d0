"""Helpers every test file needs: the standard MLP batch and tree comparisons."""

import jax
import numpy as np


def mlp_batch(rows: int = 16, key: int = 7) -> tuple[jax.Array, jax.Array]:
    """(x, y) for `_models.mlp_params`: `rows` examples of 13 inputs and 5 targets."""
    kx, ky = jax.random.split(jax.random.key(key))
    return jax.random.normal(kx, (rows, 13)), jax.random.normal(ky, (rows, 5))


def mlp_batch_dict(rows: int = 16, key: int = 7) -> dict:
    """`mlp_batch` as `{"x": ..., "y": ...}`."""
    return dict(zip(("x", "y"), mlp_batch(rows, key), strict=True))


def assert_tree_close(got, want, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Same structure, and every leaf of `got` within tolerance of `want`'s."""
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def, (got_def, want_def)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert np.shape(g) == np.shape(w), (np.shape(g), np.shape(w))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=rtol)
