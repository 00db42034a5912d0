"""The replica-group parser (`funshard/_hlo.py`) reads XLA's explicit, iota and mesh-axes
forms alike."""

import numpy as np
import pytest
from _hlo import _parser as hlo
from _hlo import collectives

from funshard._hlo import (
    Frame,
    format_groups,
    funshard_scope,
    mesh_axes_of,
    op_name_parts,
    replica_groups,
    replica_groups_attribute,
    source_of,
    stack_frames,
)


def _iota(shape, dims, perm=None):
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if perm is not None:
        ids = ids.transpose(perm)
    return tuple(tuple(int(d) for d in row) for row in ids.reshape(shape))


@pytest.mark.parametrize(
    "value, shape, dims, perm",
    [
        ("[1,8]<=[8]", (1, 8), (8,), None),
        ("[2,4]<=[8]", (2, 4), (8,), None),
        ("[4,2]<=[8]", (4, 2), (8,), None),
        ("[2,4]<=[4,2]T(1,0)", (2, 4), (4, 2), (1, 0)),
        ("[4,2]<=[2,4]T(1,0)", (4, 2), (2, 4), (1, 0)),
        ("[4,2]<=[2,2,2]T(2,0,1)", (4, 2), (2, 2, 2), (2, 0, 1)),
        ("[2,4]<=[2,2,2]T(0,2,1)", (2, 4), (2, 2, 2), (0, 2, 1)),
    ],
)
def test_iota_form_matches_numpy(value, shape, dims, perm):
    assert replica_groups(value) == _iota(shape, dims, perm)


def test_the_transposed_iota_strides_across_the_rows():
    assert replica_groups("[2,4]<=[4,2]T(1,0)") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert replica_groups("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize(
    "value, groups",
    [
        ("{{0,1,2,3,4,5,6,7}}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("{{0,1,2,3},{4,5,6,7}}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("{{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("{}", ()),
    ],
)
def test_explicit_form(value, groups):
    assert replica_groups(value) == groups
    assert format_groups(groups) == value


# The mesh-axes form jax 0.12's XLA prints for shard_map collectives, and the explicit
# form jax 0.10's XLA printed for the same programs.
@pytest.mark.parametrize(
    "value, explicit",
    [
        ("mesh['r'=2,'f'=4] {'f'}", "{{0,1,2,3},{4,5,6,7}}"),
        ("mesh['r'=2,'f'=4] {'r'}", "{{0,4},{1,5},{2,6},{3,7}}"),
        ("mesh['r'=2,'f'=4] {'f','r'}", "{{0,4,1,5,2,6,3,7}}"),
        ("mesh['r'=2,'f'=4] {'r','f'}", "{{0,1,2,3,4,5,6,7}}"),
        ("mesh['a'=2,'b'=2,'c'=2] {'c'}", "{{0,1},{2,3},{4,5},{6,7}}"),
        ("mesh['a'=2,'b'=2,'c'=2] {'b'}", "{{0,2},{1,3},{4,6},{5,7}}"),
        ("mesh['a'=2,'b'=2,'c'=2] {'c','a'}", "{{0,4,1,5},{2,6,3,7}}"),
    ],
)
def test_mesh_axes_form(value, explicit):
    assert format_groups(replica_groups(value)) == explicit


@pytest.mark.parametrize(
    "value", ["mesh['r'=2,'f'=4] {'x'}", "mesh['r'=2,'f'=4] {'f','f'}", "mesh[r=2] {'r'}"]
)
def test_malformed_mesh_values_raise(value):
    with pytest.raises(ValueError, match="replica groups"):
        replica_groups(value)


def test_both_forms_of_the_same_groups_agree():
    assert replica_groups("[4,2]<=[2,4]T(1,0)") == replica_groups("{{0,4},{1,5},{2,6},{3,7}}")
    assert replica_groups("[2,4]<=[8]") == replica_groups("{{0,1,2,3},{4,5,6,7}}")


@pytest.mark.parametrize(
    "value", ["[2,4]<=[6]", "[2,4]<=[4,2]T(0,0)", "[8]<=[8]", "0,1", "{{0,1},{2,3}"]
)
def test_malformed_values_raise(value):
    with pytest.raises(ValueError, match="replica groups"):
        replica_groups(value)


_LINES = [
    "  %ag = f32[8,4]{1,0} all-gather(f32[1,4]{1,0} %p), channel_id=1, "
    "replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true",
    "  %rs = f32[2,4]{1,0} reduce-scatter(f32[8,4]{1,0} %g), channel_id=2, "
    "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add",
    "  %ar = f32[4]{0} all-reduce(f32[4]{0} %x), channel_id=3, "
    "replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add",
    "  %ar2 = f32[4]{0} all-reduce(f32[4]{0} %y), channel_id=4, replica_groups={}, to_apply=%add",
    "  %ag2 = f32[8]{0} all-gather(f32[2]{0} %q), channel_id=6, "
    "replica_groups=mesh['r'=2,'f'=4] {'f'}, dimensions={0}, use_global_device_ids=true",
    "  %cp = f32[4]{0} collective-permute(f32[4]{0} %z), channel_id=5, "
    "source_target_pairs={{0,1},{1,0}}",
]


def test_instructions_read_in_either_form():
    assert [replica_groups_attribute(line) for line in _LINES] == [
        "[1,8]<=[8]",
        "[2,4]<=[4,2]T(1,0)",
        "{{0,4},{1,5},{2,6},{3,7}}",
        "{}",
        "mesh['r'=2,'f'=4] {'f'}",
        None,
    ]
    parsed = list(hlo.parse_collectives(_LINES))
    assert [c.group_size(8) for c in parsed] == [8, 4, 2, 8, 4, 8]
    assert [c["groups"] for c in collectives("\n".join(_LINES))] == [
        "{{0,1,2,3,4,5,6,7}}",
        "{{0,2,4,6},{1,3,5,7}}",
        "{{0,4},{1,5},{2,6},{3,7}}",
        "{}",
        "{{0,1,2,3},{4,5,6,7}}",
        None,
    ]


# ---- where a collective came from: its unit, role, mesh axes and source line ----------


def test_combined_op_names_split_into_their_parts():
    combined = "jit(f)/shard_map/(psum_invariant:transpose(jvp())/psum_invariant)"
    assert op_name_parts(combined) == [
        "jit(f)/shard_map/psum_invariant",
        "jit(f)/shard_map/transpose(jvp())/psum_invariant",
    ]
    single = "jit(f)/shard_map/transpose(jvp(funshard/a/all_gather))/all_gather"
    assert op_name_parts(single) == [single]
    assert funshard_scope(single) == ("a", "all_gather")
    assert funshard_scope("jit(f)/jvp(funshard/scan/b/reduce_scatter)/psum") == (
        "scan/b",
        "reduce_scatter",
    )
    assert funshard_scope("jit(f)/shard_map/jvp()/psum_invariant") is None


@pytest.mark.parametrize(
    "groups, axes",
    [
        (((0, 1, 2, 3), (4, 5, 6, 7)), ("f",)),
        (((0, 4), (1, 5), (2, 6), (3, 7)), ("r",)),
        ((tuple(range(8)),), ("r", "f")),
        ((), ("r", "f")),
        (tuple((i,) for i in range(8)), ()),
        (((0, 1), (2, 3), (4, 5), (6, 7)), None),  # half of "f": no set of axes
    ],
)
def test_groups_name_their_mesh_axes(groups, axes):
    assert mesh_axes_of(groups, [("r", 2), ("f", 4)]) == axes


_FRAMES = """HloModule m

FileNames
1 "/home/user/train.py"
2 "/site/funshard/core/_step.py"

FunctionNames
1 "loss"
2 "_per_device"

FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=3 end_column=9}
2 {file_name_id=2 function_name_id=2 line=269 end_line=269 column=8 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
"""


def test_stack_frames_resolve_to_the_first_frame_outside_the_libraries():
    frames = stack_frames(_FRAMES)
    assert frames[1] == Frame("/home/user/train.py", "loss", 12, None)
    assert frames[2].parent == 1
    assert source_of(2, frames, ["/site/funshard/"]) == frames[1]
    assert source_of(2, frames) == frames[2]
    assert source_of(None, frames) is None
    assert stack_frames("HloModule m\n") == {}


def test_a_compiled_step_names_each_collective():
    """On HSDP 2x4: the unit's collectives by role and axes, the loss's own psum with
    its line, the step's own loss average as library code."""
    import jax
    import jax.numpy as jnp
    from _models import mlp_layer, mlp_params, mse
    from _util import mlp_batch
    from conftest import mesh_for

    import funshard as fs
    from funshard.planning._compiled import step_collectives

    mesh = mesh_for("2x4")
    unit = fs.fully_shard(mlp_layer, name="mlp_block")

    def loss(state, batch):
        h = batch[0]
        for p in state["layers"]:
            h = unit(p, h)
        extra = jax.lax.psum(jnp.sum(h), "fsdp")  # the loss's own collective
        return mse(h * state["scale"], batch[1]) + 0.0 * extra

    state = fs.shard(mlp_params(jax.random.key(0)), mesh)
    step = fs.value_and_grad(loss, microbatches=2)
    text = jax.jit(step).lower(state, mlp_batch()).compile().as_text()
    found = step_collectives(text, [(str(a), int(s)) for a, s in mesh.shape.items()])
    unit_ops = [c for c in found if c.unit == "mlp_block"]
    roles = {(c.kind, c.role, c.axes, c.group, c.times) for c in unit_ops}
    assert roles >= {
        ("all-gather", "forward", ("fsdp",), 4, 2),
        ("all-gather", "backward", ("fsdp",), 4, 2),
        ("reduce-scatter", "gradients", ("fsdp",), 4, 2),
        ("all-reduce", "replicas", ("replicate",), 2, 2),
    }, roles
    forward = sorted(c.bytes for c in unit_ops if c.role == "forward")
    assert forward == sorted(c.bytes for c in unit_ops if c.role == "gradients")
    line = loss.__code__.co_firstlineno + 4
    written = [c for c in found if c.role == "loss"]
    assert [(c.kind, c.axes, c.bytes, c.times) for c in written] == [
        ("all-reduce", ("fsdp",), 4, 2)
    ]
    assert written[0].source == f"{__file__}:{line} ({loss.__qualname__})"
    assert any(c.role == "library" and c.axes == ("replicate", "fsdp") for c in found)
