"""Optimizer state of every optax node type saved on 8 devices, restored onto 4, trained on.

Each case trains two steps on 8 devices, saves the state and the optimizer state with
`fs.save`, restores both with `fs.restore` onto a 4-device mesh (`like` built there from
`fs.init_optimizer` of the abstract state), and takes one more step. The parameters must
equal plain optax's after three steps on the unsharded parameters, and the restored
optimizer state must have `like`'s structure (an `optax.MaskedNode` restored as `None`
breaks the next update).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _optim_cases import batches, random_tree, reference, sharded_step
from conftest import mesh_for

import funshard as fs

pytestmark = pytest.mark.slow

TOLERANCE = 2e-6
UNEVEN = {"w": (13, 32), "even": (16, 32), "b": (13,)}  # 13 rows: padded on 8 and on 4
EVEN = {"w": (16, 32), "even": (8, 32), "b": (16,)}


def _decay_mask(params):
    # A callable mask: optax.masked then keeps a MaskedNode where it is False.
    return jax.tree.map(lambda p: p.ndim == 2, params)


# id -> (optimizer factory, wrapped with fs.shard_optimizer, logical shapes, state node type)
CASES = {
    "masked_callable": (
        lambda: optax.masked(optax.adam(1e-2), _decay_mask),
        False,
        UNEVEN,
        optax.MaskedNode,
    ),
    "empty_state": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
        False,
        UNEVEN,
        optax.EmptyState,
    ),
    "schedule": (
        lambda: optax.chain(
            optax.scale_by_adam(), optax.scale_by_schedule(optax.linear_schedule(-1e-2, -1e-3, 5))
        ),
        False,
        UNEVEN,
        optax.ScaleByScheduleState,
    ),
    "inject_hyperparams": (
        lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1),
        False,
        UNEVEN,
        optax.InjectStatefulHyperparamsState,
    ),
    "multi_steps": (
        lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
        False,
        UNEVEN,
        optax.MultiStepsState,
    ),
    "muon_even": (lambda: optax.contrib.muon(1e-2), False, EVEN, optax.contrib.MuonState),
    "muon_wrapped": (lambda: optax.contrib.muon(1e-2), True, UNEVEN, optax.contrib.MuonState),
    "multi_steps_muon_wrapped": (
        lambda: optax.MultiSteps(optax.contrib.muon(1e-2), 2).gradient_transformation(),
        True,
        UNEVEN,
        optax.contrib.MuonState,
    ),
    "adafactor_even": (
        lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
        False,
        EVEN,
        optax.FactoredState,
    ),
    "adafactor_wrapped": (
        lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
        True,
        UNEVEN,
        optax.FactoredState,
    ),
    "prodigy": (lambda: optax.contrib.prodigy(1.0), False, UNEVEN, optax.contrib.ProdigyState),
    "schedule_free_adamw": (
        lambda: optax.contrib.schedule_free_adamw(1e-2),
        False,
        UNEVEN,
        optax.contrib.ScheduleFreeState,
    ),
    "dadapt_adamw": (
        lambda: optax.contrib.dadapt_adamw(1.0),
        False,
        UNEVEN,
        optax.contrib.DAdaptAdamWState,
    ),
    "mechanize": (
        lambda: optax.contrib.mechanize(optax.adam(1e-2)),
        False,
        UNEVEN,
        optax.contrib.MechanicState,
    ),
    "dog": (lambda: optax.contrib.dog(), False, UNEVEN, optax.contrib.DoGState),
    "cocob": (lambda: optax.contrib.cocob(), False, UNEVEN, optax.contrib.COCOBState),
    "ademamix": (
        lambda: optax.contrib.ademamix(1e-2),
        False,
        UNEVEN,
        optax.contrib.ScaleByAdemamixState,
    ),
    "madgrad": (lambda: optax.contrib.madgrad(1e-2), False, UNEVEN, optax.contrib.MadgradState),
}


def _holds(tree, node_type):
    def is_node(x):
        return isinstance(x, node_type)

    return any(is_node(x) for x in jax.tree.leaves(tree, is_leaf=is_node))


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_state_resumes_onto_another_device_count(case, tmp_path):
    make_opt, wrapped, shapes, node_type = CASES[case]
    params, targets = random_tree(shapes, 0), random_tree(shapes, 1)
    opt = fs.shard_optimizer(make_opt()) if wrapped else make_opt()
    state = fs.shard(params, mesh_for("8"))
    opt_state = fs.init_optimizer(opt, state)
    step = sharded_step(opt, targets)
    for batch in batches()[:2]:
        state, opt_state = step(state, opt_state, batch)
    assert _holds(opt_state, node_type)
    fs.save(tmp_path / "ckpt", {"state": state, "opt_state": opt_state})

    abstract = fs.shard(jax.eval_shape(lambda: params), mesh_for("4"))
    like = {"state": abstract, "opt_state": fs.init_optimizer(opt, abstract)}
    restored = fs.restore(tmp_path / "ckpt", like)
    assert jax.tree.structure(restored) == jax.tree.structure(like)
    state, opt_state = step(restored["state"], restored["opt_state"], batches()[2])

    expected = reference(make_opt, params, targets, batches())
    got = fs.unshard(state)
    for k in shapes:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=TOLERANCE, err_msg=k)


def test_masked_node_state_has_a_state_dict_that_loads_back():
    # muon keeps MaskedNode where its adam or its orthogonalisation does not apply.
    params = random_tree(EVEN, 0)
    opt = optax.contrib.muon(1e-2)
    state = fs.shard(params, mesh_for("8"))
    opt_state = fs.init_optimizer(opt, state)
    _, opt_state = jax.jit(opt.update)(state, opt_state, state)
    sd = fs.state_dict(opt_state)
    plain_state = opt.update(params, opt.init(params), params)[1]
    assert sd.keys() == fs.state_dict(plain_state).keys()
    for key, value in fs.state_dict(plain_state).items():
        np.testing.assert_allclose(sd[key], value, rtol=0, atol=TOLERANCE, err_msg=key)
    like = fs.init_optimizer(opt, fs.shard(params, mesh_for("4")))
    loaded = fs.load_state_dict(sd, like)
    assert jax.tree.structure(loaded) == jax.tree.structure(like)


@pytest.mark.parametrize(
    "make_opt",
    [lambda: optax.contrib.muon(1e-2), lambda: optax.masked(optax.adam(1e-2), _decay_mask)],
    ids=["muon", "masked_callable"],
)
def test_unshard_passes_masked_nodes_through(make_opt):
    # muon keeps an optax.MaskedNode for each vector: fs.unshard of its state after an
    # update equals plain optax's state on the unsharded parameters, node types included.
    params = {k: jax.random.normal(jax.random.key(i), s) for i, (k, s) in enumerate(EVEN.items())}
    grads = jax.tree.map(jnp.sin, params)
    opt = make_opt()
    state = fs.shard(params, mesh_for("8"))
    _, opt_state = jax.jit(opt.update)(
        fs.shard(grads, mesh_for("8")), fs.init_optimizer(opt, state), state
    )
    _, expected = jax.jit(opt.update)(grads, opt.init(params), params)
    got = fs.unshard(opt_state)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    assert any(
        isinstance(x, optax.MaskedNode)
        for x in jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
