"""The replica-group parser (`funshard/_hlo.py`) reads XLA's explicit and iota forms alike."""

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


@pytest.mark.parametrize("value, shape, dims, perm", [
    ("[1,8]<=[8]", (1, 8), (8,), None),
    ("[2,4]<=[8]", (2, 4), (8,), None),
    ("[4,2]<=[8]", (4, 2), (8,), None),
    ("[2,4]<=[4,2]T(1,0)", (2, 4), (4, 2), (1, 0)),
    ("[4,2]<=[2,4]T(1,0)", (4, 2), (2, 4), (1, 0)),
    ("[4,2]<=[2,2,2]T(2,0,1)", (4, 2), (2, 2, 2), (2, 0, 1)),
    ("[2,4]<=[2,2,2]T(0,2,1)", (2, 4), (2, 2, 2), (0, 2, 1)),
])
def test_iota_form_matches_numpy(value, shape, dims, perm):
    assert replica_groups(value) == _iota(shape, dims, perm)


def test_the_transposed_iota_strides_across_the_rows():
    assert replica_groups("[2,4]<=[4,2]T(1,0)") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert replica_groups("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize("value, groups", [
    ("{{0,1,2,3,4,5,6,7}}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("{{0,1,2,3},{4,5,6,7}}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("{{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("{}", ()),
])
def test_explicit_form(value, groups):
    assert replica_groups(value) == groups
    assert format_groups(groups) == value


def test_both_forms_of_the_same_groups_agree():
    assert replica_groups("[4,2]<=[2,4]T(1,0)") == replica_groups("{{0,4},{1,5},{2,6},{3,7}}")
    assert replica_groups("[2,4]<=[8]") == replica_groups("{{0,1,2,3},{4,5,6,7}}")


@pytest.mark.parametrize("value", ["[2,4]<=[6]", "[2,4]<=[4,2]T(0,0)", "[8]<=[8]", "0,1",
                                   "{{0,1},{2,3}"])
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
    "  %ar2 = f32[4]{0} all-reduce(f32[4]{0} %y), channel_id=4, replica_groups={}, "
    "to_apply=%add",
    "  %cp = f32[4]{0} collective-permute(f32[4]{0} %z), channel_id=5, "
    "source_target_pairs={{0,1},{1,0}}",
]


def test_instructions_read_in_either_form():
    assert [replica_groups_attribute(line) for line in _LINES] == [
        "[1,8]<=[8]", "[2,4]<=[4,2]T(1,0)", "{{0,4},{1,5},{2,6},{3,7}}", "{}", None]
    parsed = list(hlo.parse_collectives(_LINES))
    assert [c.group_size(8) for c in parsed] == [8, 4, 2, 8, 8]
    assert [c["groups"] for c in collectives("\n".join(_LINES))] == [
        "{{0,1,2,3,4,5,6,7}}", "{{0,2,4,6},{1,3,5,7}}", "{{0,4},{1,5},{2,6},{3,7}}", "{}",
        None]
