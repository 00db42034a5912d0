"""User mistakes raise `funshard.errors` classes that are also the built-in they replace.

Each case makes one common mistake through the public API and checks three things: the
exception is the typed `funshard.errors` class, it is still the built-in exception that
`except ValueError:` (etc.) code catches, and its message names the offending leaf by its
key path where there is a leaf to name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for

import funshard as fs
from funshard import errors

BUILTIN = {
    errors.ShardingValueError: ValueError,
    errors.ShardingTypeError: TypeError,
    errors.UnsupportedError: NotImplementedError,
    errors.CheckpointError: ValueError,
    errors.CheckpointExistsError: FileExistsError,
    errors.CheckpointNotFoundError: FileNotFoundError,
    errors.CheckpointInFlightError: RuntimeError,
    errors.DistributedError: RuntimeError,
    errors.DistributedTimeoutError: TimeoutError,
}


def _raises(cls, fn, *args, names=None, **kwargs):
    """Calls `fn`, checks it raises `cls` (and its built-in); returns the message."""
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, errors.FunshardError)
    assert isinstance(info.value, BUILTIN[cls])
    message = str(info.value)
    if names is not None:
        assert names in message, message
    return message


def test_every_class_subclasses_its_builtin_and_the_base():
    public = {getattr(errors, name) for name in errors.__all__} - {errors.FunshardError}
    warnings = {cls for cls in public if issubclass(cls, Warning)}
    assert warnings == {errors.BackendStartedWarning}  # said, never raised by funshard
    assert issubclass(errors.BackendStartedWarning, RuntimeWarning)
    assert errors.BackendStartedWarning.__doc__
    assert public - warnings == set(BUILTIN)
    for cls, builtin in BUILTIN.items():
        assert issubclass(cls, errors.FunshardError) and issubclass(cls, builtin), cls
        assert cls.__doc__, cls
    assert fs.errors is errors


# ---- shard, reshard, placement ----


def test_a_non_numeric_leaf_in_shard():
    params = {"blocks": [{"w": jnp.ones((8, 4))}, {"w": np.array(["a", "b"], dtype=object)}]}
    message = _raises(
        errors.ShardingTypeError, fs.shard, params, mesh_for("8"), names="['blocks'][1]['w']"
    )
    assert "has dtype object" in message


def test_a_bad_mesh():
    _raises(errors.ShardingTypeError, fs.shard, {"w": jnp.ones(8)}, "fsdp")
    _raises(errors.ShardingValueError, fs.make_mesh, replicate=3, devices=jax.devices()[:8])
    _raises(
        errors.ShardingValueError, fs.shard, {"w": jnp.ones(8)}, mesh_for("8"), shard_axis="data"
    )


def test_a_bad_mixed_precision_policy():
    _raises(errors.ShardingValueError, fs.MixedPrecisionPolicy, param_dtype=jnp.int32)
    _raises(errors.ShardingTypeError, fs.MixedPrecisionPolicy, param_dtype="not a dtype")
    _raises(errors.ShardingTypeError, fs.shard, {"w": jnp.ones(8)}, mesh_for("8"), mp_policy="bf16")


def test_a_placement_dim_out_of_range():
    _raises(
        errors.ShardingValueError,
        fs.shard,
        {"emb": {"w": jnp.ones((8, 4))}},
        mesh_for("8"),
        placement=lambda path, x: fs.Shard(2),
        names="['emb']['w']",
    )


def test_resharding_an_array_of_the_wrong_shape():
    state = fs.shard({"layers": [{"w": jnp.ones((16, 4))}]}, mesh_for("8"))
    _raises(
        errors.ShardingValueError,
        fs.reshard,
        {"layers": [{"w": jnp.ones((16, 5))}]},
        state,
        names="['layers'][0]['w']",
    )
    _raises(
        errors.ShardingTypeError,
        fs.reshard,
        {"layers": [{"w": "weights"}]},
        state,
        names="['layers'][0]['w']",
    )


def test_a_sharded_leaf_used_in_math():
    state = fs.shard({"w": jnp.ones((16, 4))}, mesh_for("8"))
    message = _raises(errors.ShardingTypeError, lambda: state["w"] * 2)
    assert "shape (16, 4)" in message and "fs.unshard(state)" in message


def test_unshard_of_plain_parameters():
    _raises(errors.ShardingValueError, fs.unshard, {"w": jnp.ones(4)})


# ---- scan ----


def test_scan_over_zero_layers():
    stack = fs.shard({"w": jnp.zeros((0, 8, 8))}, mesh_for("4"), stacked=True)
    message = _raises(
        errors.ShardingValueError,
        fs.scan,
        lambda p, h: h @ p["w"],
        stack,
        jnp.ones((8, 8)),
        names="['w'] (0, 8, 8)",
    )
    assert "holds no layers" in message


def test_scan_with_hpz_is_unsupported():
    stack = fs.shard({"w": jnp.zeros((3, 8, 8))}, mesh_for("8"), stacked=True)
    _raises(
        errors.UnsupportedError,
        fs.scan,
        lambda p, h: h @ p["w"],
        stack,
        jnp.ones((8, 8)),
        reshard_after_forward=2,
    )


# ---- checkpoints ----


def _tree():
    return {"params": fs.shard({"w": jnp.arange(16.0).reshape(8, 2)}, mesh_for("8")), "step": 0}


def test_a_checkpoint_that_does_not_exist(tmp_path):
    message = _raises(errors.CheckpointNotFoundError, fs.restore, tmp_path / "step_9", _tree())
    assert "no checkpoint at" in message


def test_restoring_into_a_mismatched_tree(tmp_path):
    fs.save(tmp_path / "c", _tree())
    other = {"params": fs.shard({"w": jnp.ones((8, 3))}, mesh_for("8")), "step": 0}
    message = _raises(
        errors.CheckpointError, fs.restore, tmp_path / "c", other, names="['params']['w']"
    )
    assert "shape mismatch" in message
    (tmp_path / "empty").mkdir()
    _raises(errors.CheckpointError, fs.restore, tmp_path / "empty", _tree())


def test_saving_over_an_existing_checkpoint(tmp_path):
    fs.save(tmp_path / "c", _tree())
    _raises(errors.CheckpointExistsError, fs.save, tmp_path / "c", _tree())


def test_load_state_dict_with_a_missing_key():
    state = fs.shard({"enc": {"w": jnp.ones((8, 2))}, "b": jnp.ones(8)}, mesh_for("8"))
    sd = dict(fs.state_dict(state))
    del sd["['enc']['w']"]
    _raises(errors.ShardingValueError, fs.load_state_dict, sd, state, names="['enc']['w']")


# ---- distributed ----


def test_shard_batch_with_a_scalar_leaf():
    mesh = mesh_for("8")
    _raises(
        errors.ShardingValueError,
        fs.distributed.shard_batch,
        {"x": np.ones((8, 2)), "label": np.float32(1)},
        mesh,
        names="['label']",
    )
    _raises(errors.ShardingTypeError, fs.distributed.shard_batch, {"x": np.ones(8)}, "mesh")


# ---- catching ----


def test_one_except_clause_catches_every_funshard_error(tmp_path):
    mistakes = [
        lambda: fs.MixedPrecisionPolicy(param_dtype=jnp.int32),
        lambda: fs.unshard({"w": jnp.ones(4)}),
        lambda: fs.restore(tmp_path / "missing", _tree()),
    ]
    for mistake in mistakes:
        try:
            mistake()
        except errors.FunshardError as exc:
            assert type(exc).__module__ == "funshard.errors"
        else:
            pytest.fail("no error raised")
