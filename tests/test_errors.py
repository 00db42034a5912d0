"""Every user mistake raises TypeError / ValueError naming the leaf, never AssertionError."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for

import funshard as fs

F32 = np.float32


@contextlib.contextmanager
def user_error(exc_type, *fragments):
    """Expects `exc_type` whose message contains every literal fragment, in any order."""
    with pytest.raises(exc_type) as info:
        try:
            yield info
        except AssertionError as exc:  # a user mistake must never surface as this
            pytest.fail(f"bare AssertionError for a user mistake: {exc!r}")
    assert type(info.value) is not AssertionError
    message = str(info.value)
    for fragment in fragments:
        assert re.search(re.escape(fragment), message), (fragment, message)


def _params():
    return {"w": np.arange(15, dtype=F32).reshape(5, 3), "b": np.zeros(3, F32)}


def _loss(state, batch):
    p = fs.unshard(state)
    return jnp.mean((batch["x"] @ p["w"].T + p["b"][0]) ** 2)


def _batch(rows=8):
    return {"x": np.ones((rows, 3), F32)}


# --- shard ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwarg", ["shard_axis", "replicate_axis"])
@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_shard_unknown_axis(kwarg, mesh_name):
    with user_error(ValueError, "'nope' is not an axis of the mesh", kwarg):
        fs.shard(_params(), mesh_for(mesh_name), **{kwarg: "nope"})


def test_shard_overlapping_axes():
    with user_error(ValueError, "disjoint"):
        fs.shard(_params(), mesh_for("2x4"), shard_axis="fsdp", replicate_axis="fsdp")


def test_shard_object_dtype_leaf():
    params = {"w": np.ones((4, 2), F32), "bad": np.array([object()], dtype=object)}
    with user_error(TypeError, "leaf ['bad']", "dtype object"):
        fs.shard(params, mesh_for("8"))


def test_shard_string_array_leaf():
    params = {"layers": [{"w": np.ones((4, 2), F32)}, {"names": np.array(["a", "bc"])}]}
    with user_error(TypeError, "leaf ['layers'][1]['names']", "<U2"):
        fs.shard(params, mesh_for("4"))


def test_shard_policy_not_a_policy():
    with user_error(TypeError, "mp_policy must be an fs.MixedPrecisionPolicy", "str"):
        fs.shard(_params(), mesh_for("8"), mp_policy="bf16")


def test_shard_mesh_not_a_mesh():
    with user_error(TypeError, "mesh must be a jax.sharding.Mesh", "fs.make_mesh()"):
        fs.shard(_params(), "fsdp")


def test_shard_already_sharded():
    state = fs.shard(_params(), mesh_for("8"))
    with user_error(ValueError, "leaf ['b']", "already an fs.Sharded", "fs.unshard(state)"):
        fs.shard(state, mesh_for("8"))


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_shard_64_bit_leaf_without_x64(dtype):
    assert not jax.config.jax_enable_x64
    x = np.array([2**40 + 1, -1, 7, 1]).astype(dtype)
    with user_error(TypeError, "leaf ['w']", "jax_enable_x64", ".astype("):
        fs.shard({"w": x}, mesh_for("2"))


def test_make_mesh_bool_replicate():
    with user_error(ValueError, "replicate=True"):
        fs.make_mesh(replicate=True)


def test_empty_global_batch():
    state = fs.shard(_params(), mesh_for("8"))
    with user_error(ValueError, "leaf ['x']", "0 rows"):
        fs.value_and_grad(_loss)(state, _batch(rows=0))


def test_string_batch_leaf():
    state = fs.shard(_params(), mesh_for("8"))
    with user_error(TypeError, "leaf ['name']", "not an array"):
        fs.value_and_grad(_loss)(state, {**_batch(), "name": "abc"})


def test_numpy_string_leaf_passes_through_shard():
    state = fs.shard({**_params(), "tag": np.str_("v1")}, mesh_for("2"))
    assert state["tag"] == "v1"


# --- reshard ----------------------------------------------------------------------------


def test_reshard_missing_key():
    state = fs.shard(_params(), mesh_for("8"))
    with user_error(ValueError, "does not match the structure of `like`"):
        fs.reshard({"w": _params()["w"]}, state)


def test_reshard_extra_key():
    state = fs.shard(_params(), mesh_for("8"))
    with user_error(ValueError, "does not match the structure of `like`"):
        fs.reshard({**_params(), "extra": np.ones(2, F32)}, state)


def test_reshard_wrong_shape():
    state = fs.shard(_params(), mesh_for("2x4"))
    full = {**_params(), "w": np.ones((6, 3), F32)}
    with user_error(ValueError, "leaf ['w']", "(6, 3)", "(5, 3)"):
        fs.reshard(full, state)


def test_reshard_wrong_dtype():
    state = fs.shard(_params(), mesh_for("8"))
    full = {**_params(), "b": np.zeros(3, np.int32)}
    with user_error(ValueError, "leaf ['b']", "int32", "float32"):
        fs.reshard(full, state)


def test_reshard_non_array_leaf():
    state = fs.shard(_params(), mesh_for("8"))
    with user_error(TypeError, "leaf ['w']", "NoneType"):
        fs.reshard({**_params(), "w": None}, state)


# --- no Sharded leaves ------------------------------------------------------------------


def test_unshard_plain_tree():
    with user_error(ValueError, "unshard", "no fs.Sharded", "fs.shard(params, mesh)"):
        fs.unshard(_params())


def test_value_and_grad_plain_params():
    with user_error(ValueError, "value_and_grad", "no fs.Sharded"):
        fs.value_and_grad(_loss)(_params(), _batch())


def test_fully_shard_plain_params():
    unit = fs.fully_shard(lambda p, x: x @ p["w"].T)
    with user_error(ValueError, "fully_shard", "no fs.Sharded"):
        unit(_params(), np.ones((2, 3), F32))


# --- mixing meshes ----------------------------------------------------------------------

MESH_PAIRS = [
    pytest.param(lambda: fs.make_mesh(), lambda: fs.make_mesh(replicate=2), id="fsdp-vs-hsdp"),
    pytest.param(lambda: mesh_for("8"), lambda: mesh_for("4"), id="8-vs-4"),
]


@pytest.mark.parametrize("make_a,make_b", MESH_PAIRS)
def test_unshard_mixed_meshes(make_a, make_b):
    state = {"a": fs.shard(_params(), make_a()), "b": fs.shard(_params(), make_b())}
    with user_error(ValueError, "different meshes", "leaf ['b']", "['a']"):
        fs.unshard(state)


@pytest.mark.parametrize("make_a,make_b", MESH_PAIRS)
def test_value_and_grad_mixed_meshes(make_a, make_b):
    a, b = fs.shard(_params(), make_a()), fs.shard(_params(), make_b())
    state = {"w": a["w"], "b": b["b"]}
    with user_error(ValueError, "different meshes"):
        fs.value_and_grad(_loss)(state, _batch())
    with user_error(ValueError, "different meshes"):
        jax.jit(fs.value_and_grad(_loss))(state, _batch())


def test_unshard_of_other_mesh_inside_step():
    state = fs.shard(_params(), mesh_for("8"))
    other = fs.shard(_params(), mesh_for("4"))

    def loss(s, batch):
        return _loss(s, batch) + jnp.sum(fs.unshard(other)["b"])

    with user_error(ValueError, "running step", "leaf ['b']"):
        fs.value_and_grad(loss)(state, _batch())


def test_value_and_grad_mixed_axes():
    mesh = mesh_for("2x4")
    state = {
        "w": fs.shard(_params()["w"], mesh),
        "b": fs.shard(_params()["b"], mesh, replicate_axis=()),
    }
    with user_error(ValueError, "leaf ['w']", "one shard_axis/replicate_axis"):
        fs.value_and_grad(_loss)(state, _batch())


# --- MixedPrecisionPolicy ---------------------------------------------------------------


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_policy_integer_dtype(field):
    with user_error(ValueError, f"{field}=", "is not a floating dtype"):
        fs.MixedPrecisionPolicy(**{field: jnp.int32})


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_policy_not_a_dtype(field):
    with user_error(TypeError, f"{field}='notadtype'", "is not a dtype"):
        fs.MixedPrecisionPolicy(**{field: "notadtype"})


def test_policy_cast_forward_inputs_not_bool():
    with user_error(TypeError, "cast_forward_inputs must be a bool", "1"):
        fs.MixedPrecisionPolicy(cast_forward_inputs=1)


# --- the global batch -------------------------------------------------------------------


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_batch_not_divisible(mesh_name):
    state = fs.shard(_params(), mesh_for(mesh_name))
    batch = {"x": np.ones((6, 3), F32)}
    with user_error(ValueError, "leaf ['x']", "dimension 6", "size 8", "does not divide"):
        fs.value_and_grad(_loss)(state, batch)
    with user_error(ValueError, "leaf ['x']", "does not divide"):
        jax.jit(fs.value_and_grad(_loss))(state, batch)


def test_batch_not_divisible_names_nested_leaf():
    state = fs.shard(_params(), mesh_for("4"))
    batch = {"x": np.ones((6, 3), F32), "extra": [np.ones((6,)), np.ones((6, 2))]}
    with user_error(ValueError, "leaf ['extra'][0]", "does not divide"):
        fs.grad(_loss)(state, batch)


def test_batch_scalar_leaf():
    state = fs.shard(_params(), mesh_for("8"))
    batch = {**_batch(), "scale": np.float32(2.0)}
    with user_error(ValueError, "leaf ['scale']", "is a scalar"):
        fs.value_and_grad(_loss)(state, batch)


# --- make_mesh, fully_shard -------------------------------------------------------------


@pytest.mark.parametrize("replicate", [3, 0, -2, 16])
def test_make_mesh_replicate_not_a_divisor(replicate):
    with user_error(ValueError, f"replicate={replicate}", "dividing the number of devices (8)"):
        fs.make_mesh(replicate=replicate)


def test_fully_shard_reshard_after_forward_not_bool():
    with user_error(
        TypeError, "reshard_after_forward must be True, False or a positive int", "'yes'"
    ):
        fs.fully_shard(lambda p, x: x, reshard_after_forward="yes")


def _two_policy_params(mesh):
    bf16 = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    f16 = fs.MixedPrecisionPolicy(param_dtype=jnp.float16)
    return {
        "w": fs.shard(_params()["w"], mesh, mp_policy=bf16),
        "b": fs.shard(_params()["b"], mesh, mp_policy=f16),
    }


def test_fully_shard_unit_with_two_policies():
    unit = fs.fully_shard(lambda p, x: x @ p["w"].T + p["b"][0])
    with user_error(ValueError, "different mixed-precision policies", "['w']", "['b']"):
        unit(_two_policy_params(mesh_for("8")), np.ones((2, 3), F32))


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fully_shard_unit_with_two_policies_inside_step(reshard_after_forward):
    unit = fs.fully_shard(
        lambda p, x: x @ p["w"].T + p["b"][0], reshard_after_forward=reshard_after_forward
    )

    def loss(state, batch):
        return jnp.mean(unit(state, batch["x"]) ** 2)

    with user_error(ValueError, "different mixed-precision policies"):
        jax.jit(fs.value_and_grad(loss))(_two_policy_params(mesh_for("8")), _batch())
