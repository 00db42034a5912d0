"""HSDP: each unit's gradient is summed over the replicate axis by ONE all-reduce, the
reduce-scatter path's own (`funshard/comm/_lowering.py`), in the policy's `reduce_dtype`.

Nothing else sums it: the units' `custom_vjp` adds no implicit sum, so without that
all-reduce the step does not even trace. Checked against single-device `jax.grad` on
the full batch, against `fs.plan`, and from the program: the StableHLO funshard emits
(count and dtype per unit) and the compiled HLO (replica groups, elements).
"""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collectives
from conftest import mesh_for

import funshard as fs
from funshard._hlo import format_groups, replica_groups

LAYERS = 2
UNITS = {f"layer{i}": ("layers", i) for i in range(LAYERS)}
# The 2x4 mesh ("replicate", "fsdp"): device ids run over fsdp fastest.
REPLICA_GROUPS = "{{0,4},{1,5},{2,6},{3,7}}"
SHORT = {"f32": "float32", "bf16": "bfloat16"}  # StableHLO names -> numpy names
SHORT_OF = {jnp.float32: "f32", jnp.bfloat16: "bf16"}  # numpy dtypes -> HLO names


def _params():
    k = jax.random.split(jax.random.key(3), LAYERS + 2)
    return {
        "embed": jax.random.normal(k[0], (13, 12)) / 2,  # 13 rows: padded on 4 shards
        "layers": [
            {"w": jax.random.normal(k[i + 1], (12, 12)) / 3, "b": jnp.full(12, 0.1 * i)}
            for i in range(LAYERS)
        ],
        "head": jax.random.normal(k[-1], (12, 5)) / 3,
    }


def _batch():
    kx, ky = jax.random.split(jax.random.key(4))
    return jax.random.normal(kx, (16, 13)), jax.random.normal(ky, (16, 5))


def _forward(params, x, layers):
    h = jnp.tanh(x @ params["embed"])
    for layer, p in zip(layers, params["layers"], strict=True):
        h = layer(p, h)
    return h @ params["head"]


def _layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def _reference_loss(params, batch):
    x, y = batch
    return jnp.mean((_forward(params, x, [_layer] * LAYERS) - y) ** 2)


def _step(reshard, ends_in_unit):
    """The step; the embedding and head gathered by the root's `fs.unshard` (a plain
    `jax.custom_vjp`) or, with `ends_in_unit`, by a unit of their own (`fully_shard`)."""
    layers = [fs.fully_shard(_layer, reshard_after_forward=reshard, name=name) for name in UNITS]
    ends = fs.fully_shard(lambda p: p, reshard_after_forward=reshard, name="ends")

    def loss(state, batch):
        x, y = batch
        gather = ends if ends_in_unit else fs.unshard
        params = {
            **gather({"embed": state["embed"], "head": state["head"]}),
            "layers": state["layers"],
        }
        return jnp.mean((_forward(params, x, layers).astype(jnp.float32) - y) ** 2)

    return fs.value_and_grad(loss)


def _emitted_all_reduces(lowered_text: str, mesh) -> list[tuple[str, str, int]]:
    """(replica groups, dtype, elements) of each all-reduce in the StableHLO, before XLA
    CPU widens 16-bit all-reduces to f32 and combines them into tuples. jax 0.10 writes
    the groups as a dense list, jax 0.12 as mesh axes."""
    out = []
    pattern = (
        r"stablehlo\.all_reduce.*?replica_groups = (dense<\[\[.*?\]\]>|"
        r"#stablehlo\.replica_group_mesh_axes<.*?\]>)"
        r".*?\}\) : \(tensor<((?:\d+x)*)(\w+)>\)"
    )
    for groups, dims, dtype in re.findall(pattern, lowered_text, re.DOTALL):
        size = int(np.prod([int(d) for d in dims.split("x") if d], dtype=int))
        out.append((_groups(groups, mesh), SHORT.get(dtype, dtype), size))
    return out


def _groups(attribute: str, mesh) -> str:
    """A StableHLO `replica_groups` attribute in HLO's explicit form, `{{0,4},...}`."""
    if attribute.startswith("dense<"):
        return re.sub(r"\s", "", attribute[len("dense<") : -1]).replace("[", "{").replace("]", "}")
    axes = ",".join(f"'{a}'" for a in re.findall(r'name = "([^"]+)"', attribute))
    sizes = ",".join(f"'{a}'={n}" for a, n in mesh.shape.items())
    return format_groups(replica_groups(f"mesh[{sizes}] {{{axes}}}"))


@pytest.mark.parametrize("ends_in_unit", [False, True], ids=["root", "unit"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("reduce_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_each_unit_is_all_reduced_once_over_the_replicas(reduce_dtype, reshard, ends_in_unit):
    mesh = mesh_for("2x4")
    policy = fs.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    state = fs.shard(_params(), mesh, mp_policy=policy)
    batch = _batch()
    step = jax.jit(_step(reshard, ends_in_unit))
    units = {**UNITS, "ends": ["embed", "head"]} if ends_in_unit else UNITS

    loss, grads = step(state, batch)
    want_loss, want = jax.value_and_grad(_reference_loss)(_params(), batch)
    tol = 1e-5 if reduce_dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=tol, atol=tol), fs.unshard(grads), want
    )

    # fs.plan's promise: per unit (the root's gather too) one all-reduce over the 2 replicas, in
    # reduce_dtype, of the unit's local gradient shard.
    planned = [
        c
        for c in fs.plan(_params(), mesh, units=units, mp_policy=policy).collectives
        if c.kind == "all-reduce" and c.role == "replicas"
    ]
    ends = "ends" if ends_in_unit else "root"
    assert sorted(c.unit for c in planned) == sorted(["layer0", "layer1", ends])
    assert {(c.group, c.dtype, c.times) for c in planned} == {(2, np.dtype(reduce_dtype).name, 1)}
    itemsize = np.dtype(reduce_dtype).itemsize
    elements = Counter(c.bytes // itemsize for c in planned)
    # 12 x 12 + 12 values over 4 shards per layer; 16 (padded) x 12 + 12 x 5 for the ends.
    assert elements == Counter({3 * 12 + 3: 2, 4 * 12 + 3 * 5: 1})

    # What funshard emits: exactly those all-reduces over the replica groups (a second
    # sum of a unit's gradient, or one per leaf, would show here), plus the loss's.
    lowered = step.lower(state, batch)
    emitted = _emitted_all_reduces(lowered.as_text(), mesh)
    over_replicas = [(d, n) for g, d, n in emitted if g == REPLICA_GROUPS]
    assert Counter(over_replicas) == Counter(
        {(np.dtype(reduce_dtype).name, n): k for n, k in elements.items()}
    ), emitted
    assert [(d, n) for g, d, n in emitted if g != REPLICA_GROUPS] == [("float32", 1)], emitted

    # The compiled program: the same elements over the replica groups (XLA may combine
    # the all-reduces into one tuple-shaped op). XLA CPU runs 16-bit all-reduces in f32
    # (float normalization); other platforms keep reduce_dtype.
    compiled = [c for c in collectives(lowered.compile().as_text()) if c["kind"] == "all-reduce"]
    by_groups = [c for c in compiled if c["groups"] == REPLICA_GROUPS]
    assert by_groups and sum(c["elements"] for c in by_groups) == sum(elements.elements())
    widened = jax.devices()[0].platform == "cpu" and itemsize < 4
    assert {c["dtype"] for c in by_groups} == {"f32" if widened else SHORT_OF[reduce_dtype]}
    others = [(c["groups"], c["elements"]) for c in compiled if c["groups"] != REPLICA_GROUPS]
    assert others == [("{{0,1,2,3,4,5,6,7}}", 1)], compiled  # the loss
