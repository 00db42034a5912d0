"""The replica-group parser (`funshard/_hlo.py`) reads XLA's explicit, iota and mesh-axes
forms alike."""

import numpy as np
import pytest
from _hlo import _parser as hlo
from _hlo import collectives

from funshard._hlo import format_groups, replica_groups, replica_groups_attribute


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
