"""Mistakes a user makes with meshes, state dicts and `Sharded` leaves: clear errors.

Each test checks the exception type and that the message names what is wrong and the
fix; the valid call next to each mistake is the reference that must still work.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import mlp_apply, mlp_params
from conftest import mesh_for

import funshard as fs


@pytest.fixture(scope="module")
def state():
    return fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))


def test_make_mesh_rejects_an_empty_device_list():
    with pytest.raises(ValueError, match=r"make_mesh: devices is empty.*jax\.devices\(\)"):
        fs.make_mesh(devices=[])
    with pytest.raises(ValueError, match="devices is empty"):
        fs.make_mesh(replicate=1, devices=iter(()))


def test_make_mesh_rejects_a_repeated_device():
    d = jax.devices()
    with pytest.raises(ValueError) as info:
        fs.make_mesh(devices=[d[0], d[1], d[0], d[1]])
    msg = str(info.value)
    assert "more than once" in msg and "distinct devices" in msg
    assert f"{d[0]} at positions [0, 2]" in msg and f"{d[1]} at positions [1, 3]" in msg
    with pytest.raises(ValueError, match="more than once"):
        fs.make_mesh(replicate=2, devices=[d[3]] * 4)
    assert fs.make_mesh(devices=d[:4]).devices.size == 4  # distinct devices still work


@pytest.mark.parametrize("sd", [None, [("['w']", np.zeros(3))], "state.npz"])
def test_load_state_dict_rejects_a_non_mapping(state, sd):
    with pytest.raises(
        TypeError,
        match=rf"load_state_dict: sd is a {type(sd).__name__}.*"
        r"fs\.state_dict\(tree\)",
    ):
        fs.load_state_dict(sd, state)


def test_load_state_dict_rejects_a_nested_tree_and_bad_entries(state):
    # The common mistake: the full parameter tree instead of its flat state dict.
    with pytest.raises(TypeError) as info:
        fs.load_state_dict(fs.unshard(state), state)
    msg = str(info.value)
    assert "'layers': list" in msg and r"fs.reshard(full_tree, like)" in msg
    sd = dict(fs.state_dict(state))
    sd[3] = np.zeros(2)
    sd["['scale']"] = "1.5"
    with pytest.raises(TypeError) as info:
        fs.load_state_dict(sd, state)
    msg = str(info.value)
    assert "  3: ndarray" in msg and "  \"['scale']\": str" in msg
    del sd[3]
    sd["['scale']"] = np.float32(1.5)  # a numpy scalar is a fine 0-d value
    back = fs.load_state_dict(sd, state)
    np.testing.assert_array_equal(np.asarray(fs.unshard(back)["scale"]), np.float32(1.5))


def _user_code(state):
    """Ways a Sharded leaf reaches user code that expects an array."""
    w = state["layers"][0]["w"]
    x = jnp.ones((2, 13))
    return {
        "jnp.asarray": lambda: jnp.asarray(w),
        "np.asarray": lambda: np.asarray(w),
        "jnp.dot": lambda: jnp.dot(x, w),
        "x @ w (jax)": lambda: x @ w,
        "x @ w (numpy)": lambda: np.ones((2, 13), np.float32) @ w,
        "w + 1": lambda: w + 1,
        "1.0 * w": lambda: 1.0 * w,
        "-w": lambda: -w,
        "w[0]": lambda: w[0],
        "for row in w": lambda: list(w),
        "apply on the state": lambda: mlp_apply(state, x),
        "apply under jit": lambda: jax.jit(mlp_apply)(state, x),
    }


# (how the message starts, the user's expression, the fix it shows or None): the
# expression and the fix are the user's own code, read from its source line.
_CONVERTS, _LEAF = "converting an fs.Sharded leaf", " of shape (13, 32) and dtype float32"
_REFUSALS = {
    "jnp.asarray": (_CONVERTS, "`jnp.asarray(w)` in ", "`jnp.asarray(fs.unshard(w))`"),
    "np.asarray": (_CONVERTS, "`np.asarray(w)` in ", "`np.asarray(fs.unshard(w))`"),
    "jnp.dot": (_CONVERTS, "`jnp.dot(x, w)` in ", "`jnp.dot(x, fs.unshard(w))`"),
    "x @ w (jax)": (_CONVERTS, "`x @ w` in ", "`x @ fs.unshard(w)`"),
    "x @ w (numpy)": ("operator @ on an fs.Sharded leaf", "@ w` in ", "@ fs.unshard(w)`"),
    "w + 1": ("operator + on an fs.Sharded leaf", "`w + 1` in ", "`fs.unshard(w) + 1`"),
    "1.0 * w": ("operator * on an fs.Sharded leaf", "`1.0 * w` in ", "`1.0 * fs.unshard(w)`"),
    "-w": ("operator - on an fs.Sharded leaf", "`-w` in ", "`-fs.unshard(w)`"),
    "w[0]": ("indexing an fs.Sharded leaf", "`w[0]` in ", "`fs.unshard(w)[0]`"),
    "for row in w": ("iterating over an fs.Sharded leaf", "`list(w)` in ", "`list(fs.unshard(w))`"),
    "apply on the state": (_CONVERTS, "`h @ p['w']` in mlp_layer (", "`h @ fs.unshard(p['w'])`"),
    "apply under jit": (_CONVERTS, "`h @ p['w']` in mlp_layer (", "`h @ fs.unshard(p['w'])`"),
}


@pytest.mark.parametrize("how", list(_user_code({"layers": [{"w": None}]})))
def test_sharded_leaf_in_user_code_names_the_expression_and_the_fix(state, how):
    with pytest.raises(TypeError) as info:
        _user_code(state)[how]()
    msg = str(info.value)
    start, expression, fix = _REFUSALS[how]
    assert msg.startswith(start + _LEAF) or msg.startswith(start.replace(" leaf", _LEAF)), msg
    assert expression in msg, msg
    assert fix is None or fix in msg, msg
    assert "fs.unshard(state) once for the whole state" in msg and "fs.fully_shard" in msg


def test_refusals_stop_user_math_but_not_the_pytree_machinery(state):
    with pytest.raises(TypeError, match=r"`jnp\.asarray\(fs\.unshard\(state\['layers'\]"):
        jnp.asarray(state["layers"][1]["b"])
    # jax's own flattening, jit and tree maps reach the data, never the refusals.
    doubled = jax.jit(lambda s: jax.tree.map(lambda a: 2 * a, s))(state)
    np.testing.assert_array_equal(
        np.asarray(fs.unshard(doubled)["layers"][0]["w"]),
        2 * np.asarray(fs.unshard(state)["layers"][0]["w"]),
    )
    assert mlp_apply(fs.unshard(state), jnp.ones((2, 13))).shape == (2, 5)


def test_repr_is_one_short_line_without_values():
    mesh = mesh_for("2x4")
    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    w = jnp.full((1024, 512), 0.123456, jnp.float32)
    leaf = fs.shard({"w": w}, mesh, mp_policy=policy)["w"]
    text = repr(leaf)
    assert "\n" not in text and len(text) < 300
    assert text.startswith(
        "Sharded(shape=(1024, 512), dtype=float32, rows_per_shard=256, "
        "shard_axis=('fsdp',), replicate_axis=('replicate',), "
        "mesh={'replicate': 2, 'fsdp': 4}, mp_policy="
    )
    assert "bfloat16" in text and "0.123" not in text
    # A whole model prints in a few lines per leaf, not its values.
    state = fs.shard({"blocks": [{"w": w, "b": jnp.zeros(512)}] * 8}, mesh_for("8"))
    assert len(repr(state)) < 16 * 150
    assert repr(fs.shard({"w": w}, mesh_for("8"))["w"]) == (
        "Sharded(shape=(1024, 512), dtype=float32, rows_per_shard=128, "
        "shard_axis=('fsdp',), mesh={'fsdp': 8})"
    )
