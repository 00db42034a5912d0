"""Optimizers that look at whole matrices on uneven leaves: `fs.shard_optimizer` and the probe.

Each training test runs a whole jitted step (`fs.value_and_grad`, `opt.update`,
`optax.apply_updates`) for a few steps on a tree of uneven and even leaves, and compares
the parameters with plain optax on the unsharded parameters (the reference), on 8
devices and on a 2x4 HSDP mesh. Unwrapped, adafactor is off by ~2e-4 and muon by ~3e-3
there; the tolerance is far below that.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import collectives
from _optim_cases import batches, loss, random_tree, reference, sharded_step
from conftest import mesh_for

import funshard as fs

STEPS = 3
TOLERANCE = 2e-6  # the unwrapped optimizers are off by 1e-4 to 1e-2


def _adafactor():
    return optax.adafactor(1e-2)


def _muon():
    return optax.contrib.muon(1e-2)


def _lamb():
    return optax.lamb(1e-2, weight_decay=0.1)


def _masked_chain():
    # adafactor on matrices, AdamW on the rest, adafactor masked off the even matrix.
    def labels(p):
        return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", p)

    def only_uneven(p):
        return {k: k != "even" for k in p}

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.multi_transform(
            {
                "matrix": optax.masked(optax.adafactor(1e-2), only_uneven),
                "vector": optax.adamw(1e-2, weight_decay=0.1),
            },
            labels,
        ),
    )


# (transform, logical shapes): adafactor factors only dims of at least 128.
CASES = {
    "adafactor": (_adafactor, {"uneven": (130, 128), "even": (136, 128), "bias": (13,)}),
    "muon": (_muon, {"uneven": (13, 32), "even": (16, 32), "bias": (13,)}),
    "lamb": (_lamb, {"uneven": (13, 32), "even": (16, 32), "bias": (13,)}),
    "masked_chain": (_masked_chain, {"uneven": (130, 128), "even": (136, 128), "bias": (13,)}),
}


def _params(shapes):
    return random_tree(shapes, 0)


def _targets(shapes):
    return random_tree(shapes, 1)


def _trains_as_optax(opt, make_opt, shapes, mesh_name):
    """Trains `opt` (from `fs.init_optimizer`) for STEPS steps on `shapes` sharded over
    the mesh `mesh_name`, checks the parameters against plain optax; returns the step."""
    params, targets = _params(shapes), _targets(shapes)
    state = fs.shard(params, mesh_for(mesh_name))
    opt_state = fs.init_optimizer(opt, state)
    step = sharded_step(opt, targets)
    for batch in batches(STEPS):
        state, opt_state = step(state, opt_state, batch)
    expected = reference(make_opt, params, targets, batches(STEPS))
    got = fs.unshard(state)
    for k in shapes:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=TOLERANCE, err_msg=k)
    return step


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_shard_optimizer_matches_optax(case, mesh_name):
    make_opt, shapes = CASES[case]
    step = _trains_as_optax(fs.shard_optimizer(make_opt()), make_opt, shapes, mesh_name)
    assert step._cache_size() == 1  # the initial optimizer state is laid out as the step's


def test_moments_of_uneven_leaves_stay_sharded():
    params = _params({"uneven": (13, 32), "bias": (13,)})
    state = fs.shard(params, mesh_for("8"))
    opt_state = fs.init_optimizer(fs.shard_optimizer(optax.adam(1e-2)), state)
    mu = opt_state[0].mu["uneven"]
    assert isinstance(mu, fs.Sharded) and mu.data.shape == (16, 32)
    assert mu.data.sharding == state["uneven"].data.sharding
    assert not np.any(np.asarray(mu.data)[13:])


def test_factored_statistics_of_uneven_leaves_are_replicated():
    state = fs.shard(_params({"uneven": (130, 128)}), mesh_for("8"))
    opt_state = fs.init_optimizer(fs.shard_optimizer(_adafactor()), state)
    v_col = opt_state[0].v_col["uneven"].data
    assert v_col.shape == (130,) and v_col.sharding.is_fully_replicated


def test_wrapped_state_saves_restores_and_has_a_state_dict(tmp_path):
    # adafactor's statistics are not Sharded leaves of the wrapper's state, so the
    # checkpoint functions treat them as plain arrays (inside a Sharded node they fail).
    state = fs.shard(_params({"uneven": (130, 128), "even": (136, 128)}), mesh_for("8"))
    opt = fs.shard_optimizer(_adafactor())
    opt_state = fs.init_optimizer(opt, state)
    _, opt_state = jax.jit(opt.update)(state, opt_state, state)
    fs.save(tmp_path / "opt", opt_state)
    restored = fs.restore(tmp_path / "opt", fs.init_optimizer(opt, jax.eval_shape(lambda: state)))
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(restored), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)
    shapes = {k: v.shape for k, v in fs.state_dict(opt_state).items()}
    assert shapes["[0].v_col['uneven'].data"] == (130,)
    assert shapes["[0].v_col['even'].data"] == (136,)


@pytest.mark.parametrize(
    "make_opt, shape, padded",
    [
        (_adafactor, (130, 128), (136, 128)),
        # muon on a (130, 128) leaf is exact padded: it orthogonalises the 128 columns.
        (_muon, (13, 32), (16, 32)),
    ],
    ids=["adafactor", "muon"],
)
def test_init_optimizer_refuses_padding_dependent_transform(make_opt, shape, padded):
    state = fs.shard(_params({"even": (16, 128), "uneven": shape}), mesh_for("8"))
    with pytest.raises(fs.errors.ShardingValueError) as info:
        fs.init_optimizer(make_opt(), state)
    message = str(info.value)
    assert f"['uneven'] (shape {shape}, padded to {padded} over 8 shards)" in message
    assert "fs.shard_optimizer(opt)" in message
    assert "['even']" not in message


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optax.adamw(1e-2, weight_decay=0.1),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        lambda: optax.sgd(1e-2, momentum=0.9),
        lambda: optax.lion(1e-3),
        _lamb,
    ],
    ids=["adamw", "clip_adamw", "sgd", "lion", "lamb"],
)
def test_element_wise_transforms_pass_the_probe_on_uneven_leaves(make_opt):
    state = fs.shard(_params({"uneven": (13, 32), "bias": (13,)}), mesh_for("8"))
    fs.init_optimizer(make_opt(), state)


def test_any_transform_passes_the_probe_on_even_leaves():
    state = fs.shard(_params({"even": (136, 128), "bias": (16,)}), mesh_for("8"))
    fs.init_optimizer(_adafactor(), state)


def test_wrapped_transform_passes_the_probe_inside_a_chain():
    state = fs.shard(_params({"uneven": (130, 128)}), mesh_for("8"))
    fs.init_optimizer(fs.shard_optimizer(_adafactor()), state)
    chained = optax.chain(optax.clip_by_global_norm(1.0), fs.shard_optimizer(_adafactor()))
    fs.init_optimizer(chained, state)


def test_abstract_state_gives_the_optimizer_state_layout():
    state = fs.shard(_params({"uneven": (130, 128), "even": (136, 128)}), mesh_for("8"))
    opt = fs.shard_optimizer(_adafactor())
    abstract = fs.init_optimizer(opt, jax.eval_shape(lambda: state))
    concrete = fs.init_optimizer(opt, state)

    def shardings(tree):
        return [x.sharding for x in jax.tree.leaves(tree)]

    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    assert shardings(abstract) == shardings(concrete)


def _without_metadata(hlo: str) -> str:
    """The program without source locations (the wrapper adds Python frames, not ops)."""
    program = hlo.split("\nFileNames\n")[0]
    return re.sub(r", metadata=\{[^}]*\}", "", program)


def _compiled_update(opt, state):
    opt_state = fs.init_optimizer(opt, state)
    update = jax.jit(lambda g, o, s: opt.update(g, o, s))
    return update.lower(state, opt_state, state).compile()


def test_even_leaves_compile_to_plain_optax():
    state = fs.shard(_params({"even": (136, 128), "bias": (16,)}), mesh_for("8"))
    plain = _compiled_update(_adafactor(), state)
    wrapped = _compiled_update(fs.shard_optimizer(_adafactor()), state)
    assert _without_metadata(wrapped.as_text()) == _without_metadata(plain.as_text())
    assert (
        wrapped.memory_analysis().temp_size_in_bytes == plain.memory_analysis().temp_size_in_bytes
    )


def test_uneven_leaf_costs_its_gathers():
    # AdamW (which needs no wrapper) wrapped: the update, the parameter and both moments
    # of the uneven leaf are gathered; the even leaf adds nothing.
    state = fs.shard(_params({"uneven": (13, 32), "even": (16, 32)}), mesh_for("8"))

    def opt():
        return optax.adamw(1e-2, weight_decay=0.1)

    plain = _compiled_update(opt(), state)
    wrapped = _compiled_update(fs.shard_optimizer(opt()), state)
    gathers = [c for c in collectives(wrapped.as_text()) if c["kind"] == "all-gather"]
    assert not collectives(plain.as_text())
    assert sorted(c["elements"] for c in gathers) == [16 * 32] * 4


def test_probe_says_the_fix_once_and_lists_each_leaf():
    state = fs.shard(_params({"a": (130, 128), "b": (13,), "even": (16,)}), mesh_for("8"))
    with pytest.raises(fs.errors.ShardingValueError) as info:
        fs.init_optimizer(_adafactor(), state)
    message = str(info.value)
    assert message.count("fs.shard_optimizer(opt)") == 1
    assert "whole padded matrix" not in message
    listed = [line.strip() for line in message.splitlines() if line.startswith("  ")]
    assert listed == [
        "['a'] (shape (130, 128), padded to (136, 128) over 8 shards)",
        "['b'] (shape (13,), padded to (16,) over 8 shards)",
    ]


def _frozen_uneven():
    # AdamW on the even leaves; the uneven one frozen: its update is zero whatever.
    def labels(p):
        return {k: "frozen" if k == "uneven" else "train" for k in p}

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.multi_transform({"train": optax.adamw(1e-2), "frozen": optax.set_to_zero()}, labels),
    )


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optax.chain(optax.scale_by_lbfgs(), optax.scale(-1e-2)),
        lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
        _frozen_uneven,
    ],
    ids=["scale_by_lbfgs", "multi_steps_adam", "frozen_uneven_leaf"],
)
def test_exact_transforms_pass_the_probe_and_train_as_optax(make_opt):
    # L-BFGS keeps a memory of past steps with the padded rows one axis in; MultiSteps
    # emits nothing on its first step; a frozen leaf never moves: none depends on padding.
    shapes = {"uneven": (13, 32), "even": (16, 32), "bias": (13,)}
    _trains_as_optax(make_opt(), make_opt, shapes, "8")


def _needs_loss_scale():
    def update(updates, state, params=None, *, loss_scale):
        return jax.tree.map(lambda u: u / loss_scale, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


UNDECIDED = "could not tell whether the optimizer's update of these uneven leaves"
DEPENDS = "the optimizer's update of these uneven leaves depends on their zero padding rows"


@pytest.mark.parametrize(
    "make_opt, says",
    [
        # reduce_on_plateau's value= comes from the probe's loss: muon is seen and refused.
        (lambda: optax.chain(_muon(), optax.contrib.reduce_on_plateau()), DEPENDS),
        (lambda: optax.MultiSteps(_muon(), 4).gradient_transformation(), DEPENDS),
        (lambda: optax.MultiSteps(_muon(), 4), DEPENDS),
        (lambda: optax.contrib.muon(optax.linear_schedule(0.0, 1e-2, 10)), DEPENDS),
        (
            lambda: optax.chain(
                optax.clip(1.0), optax.MultiSteps(_muon(), 8).gradient_transformation()
            ),
            UNDECIDED + " depends on their zero padding rows: their updates stayed zero",
        ),
        (_needs_loss_scale, UNDECIDED + " depends on their zero padding rows: the probe could"),
    ],
    ids=[
        "muon_reduce_on_plateau",
        "multi_steps_muon",
        "multi_steps_object",
        "muon_warmup_from_zero",
        "multi_steps_in_chain",
        "unknown_extra_argument",
    ],
)
def test_probe_refuses_what_it_cannot_show_exact(make_opt, says):
    state = fs.shard(_params({"uneven": (13, 32), "even": (16, 32)}), mesh_for("8"))
    with pytest.raises(fs.errors.ShardingValueError) as info:
        fs.init_optimizer(make_opt(), state)
    message = str(info.value)
    assert message.startswith(f"init_optimizer: {says}")
    assert "\n  ['uneven'] (shape (13, 32), padded to (16, 32) over 8 shards)\n" in message
    assert "['even']" not in message
    assert message.count("fs.shard_optimizer(opt)") == 1


def _value_step(opt, targets, batch):
    """A step that passes value=, grad= and value_fn= (as optax.lbfgs's docs do)."""

    def loss_fn(state, batch):
        return loss(fs.unshard(state), targets, batch)

    @jax.jit
    def step(state, opt_state):
        value, grads = fs.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = opt.update(
            grads,
            opt_state,
            state,
            value=value,
            grad=grads,
            value_fn=lambda s: loss(fs.unshard(s), targets, batch),
        )
        return optax.apply_updates(state, updates), opt_state

    return step


@jax.jit(static_argnums=0)
def _valuereference(make_opt, params, targets, batch):
    opt = make_opt()
    opt_state = opt.init(params)

    def value_fn(p):
        return loss(p, targets, batch)

    def one_step(_, carry):  # a loop, not unrolled: L-BFGS's line search compiles once
        params, opt_state = carry
        value, grads = jax.value_and_grad(value_fn)(params)
        updates, opt_state = opt.update(
            grads, opt_state, params, value=value, grad=grads, value_fn=value_fn
        )
        return optax.apply_updates(params, updates), opt_state

    return jax.lax.fori_loop(0, STEPS, one_step, (params, opt_state))[0]


def _lbfgs():  # one function for both L-BFGS cases: they share one compiled reference
    return optax.lbfgs()


@pytest.mark.parametrize(
    "make_opt, wrap",
    [
        (_lbfgs, True),
        (_lbfgs, False),
        (lambda: optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau()), False),
        (lambda: optax.chain(_muon(), optax.contrib.reduce_on_plateau()), True),
    ],
    ids=["lbfgs_wrapped", "lbfgs", "adam_reduce_on_plateau", "muon_reduce_on_plateau_wrapped"],
)
@pytest.mark.slow  # L-BFGS's line search: about 20 s a case on 2 cores
def test_extra_arguments_train_as_optax(make_opt, wrap):
    # The wrapper cuts grad= like the updates and calls value_fn on the sharded layout.
    shapes = {"uneven": (13, 32), "even": (16, 32), "bias": (13,)}
    params, targets = _params(shapes), _targets(shapes)
    batch = jnp.arange(8.0) / 8
    state = fs.shard(params, mesh_for("8"))
    opt = fs.shard_optimizer(make_opt()) if wrap else make_opt()
    opt_state = fs.init_optimizer(opt, state)
    step = _value_step(opt, targets, batch)
    for _ in range(STEPS):
        state, opt_state = step(state, opt_state)
    expected = _valuereference(make_opt, params, targets, batch)
    got = fs.unshard(state)
    for k in shapes:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=TOLERANCE, err_msg=k)


def _probes_run(monkeypatch):
    """A list that gets one entry per probe traced (cached verdicts add none)."""
    from funshard.core import _padding_probe

    runs = []
    lowered_runs = _padding_probe._lowered_runs

    def counted(*args):
        runs.append(args)
        return lowered_runs(*args)

    monkeypatch.setattr(_padding_probe, "_lowered_runs", counted)
    return runs


def _fresh_verdict(opt, state):
    """The probe's verdict with its caches emptied: the reference for a cached one."""
    from funshard.core import _padding_probe

    _padding_probe._VERDICTS.clear()
    _padding_probe._PROGRAM_VERDICTS.clear()
    return _padding_probe.padding_dependence(opt, state)


def _accepted(verdict):
    return not (verdict.updates or verdict.states or verdict.undecided)


def test_equal_transforms_share_a_verdict_without_tracing(monkeypatch):
    from funshard.core import _padding_probe

    state = fs.shard(_params({"uneven": (11, 24), "bias": (11,)}), mesh_for("8"))
    runs = _probes_run(monkeypatch)

    def adamw(lr):
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.1))

    first = _padding_probe.padding_dependence(adamw(1e-3), state)
    again = _padding_probe.padding_dependence(adamw(1e-3), state)  # a new, equal object
    assert len(runs) == 1 and again == first
    _padding_probe.padding_dependence(adamw(2e-3), state)  # another learning rate
    assert len(runs) == 2
    assert first == _fresh_verdict(adamw(1e-3), state) and _accepted(first)


def _masked_adafactor(uneven):
    # Equal code; the closed-over flag decides whether the uneven leaf is masked in.
    return optax.masked(optax.adafactor(1e-2), lambda p: {k: uneven or k != "uneven" for k in p})


def test_transforms_differing_in_a_closed_over_value_get_their_own_verdicts():
    from funshard.core import _padding_probe

    state = fs.shard(_params({"uneven": (130, 128), "even": (136, 128)}), mesh_for("8"))
    cached = [_padding_probe.padding_dependence(_masked_adafactor(u), state) for u in (True, False)]
    fresh = [_fresh_verdict(_masked_adafactor(u), state) for u in (True, False)]
    assert cached == fresh
    assert fresh[0].updates and _accepted(fresh[1])


_PEAK = 1e-2  # read from the module's globals by _global_schedule


def _global_schedule(step):
    return _PEAK * jnp.minimum(1.0, step / 10)


def test_a_global_scalar_a_transform_reads_is_part_of_its_key(monkeypatch):
    # muon warmed up from 0 is refused with a nonzero peak; with a peak of 0 every update
    # is zero while the state accumulates, and the probe says it cannot tell.
    state = fs.shard(_params({"uneven": (13, 32), "even": (16, 32)}), mesh_for("8"))
    with pytest.raises(fs.errors.ShardingValueError, match=DEPENDS):
        fs.init_optimizer(optax.contrib.muon(_global_schedule), state)
    monkeypatch.setattr(__import__(__name__), "_PEAK", 0.0)
    with pytest.raises(fs.errors.ShardingValueError, match=UNDECIDED):
        fs.init_optimizer(optax.contrib.muon(_global_schedule), state)


def test_cached_verdict_names_the_shard_count_of_its_state():
    # (13, 32) pads to (16, 32) over 8 shards and over 4: the same program, other text.
    opt = _muon()
    for mesh_name, shards in (("8", 8), ("4", 4)):
        state = fs.shard(_params({"uneven": (13, 32)}), mesh_for(mesh_name))
        with pytest.raises(fs.errors.ShardingValueError) as info:
            fs.init_optimizer(opt, state)
        assert f"padded to (16, 32) over {shards} shards" in str(info.value)
        state = fs.shard(_params({"uneven": (13, 32)}), mesh_for(mesh_name))
        with pytest.raises(fs.errors.ShardingValueError) as info:
            fs.init_optimizer(_muon(), state)  # an equal transform, cached by value
        assert f"padded to (16, 32) over {shards} shards" in str(info.value)


def test_probe_compiles_with_its_fast_options_and_falls_back(monkeypatch):
    from funshard.core import _padding_probe

    lowered = jax.jit(lambda x: jnp.sum(jnp.cos(x))).lower(np.ones((13, 32), np.float32))
    # jax 0.10's XLA takes the fastest set, so the probe's cost does not silently grow
    # back; jax 0.12's has no legacy emitters left and refuses it ("No such compile
    # option"), so the probe compiles with the next set there.
    fastest = _padding_probe._COMPILER_OPTIONS[0]
    if jax.__version_info__ < (0, 11):
        lowered.compile(compiler_options=fastest)
    else:
        with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
            lowered.compile(compiler_options=fastest)
        lowered.compile(compiler_options=_padding_probe._COMPILER_OPTIONS[1])
    # An XLA without an option refuses the set; the probe takes the next and still judges.
    unknown = {"xla_option_this_xla_does_not_have": True}
    monkeypatch.setattr(_padding_probe, "_COMPILER_OPTIONS", (unknown, {}))
    state = fs.shard(_params({"uneven": (130, 128), "even": (136, 128)}), mesh_for("8"))
    assert _fresh_verdict(_adafactor(), state).updates == (
        "['uneven'] (shape (130, 128), padded to (136, 128) over 8 shards)",
    )
    assert _accepted(_fresh_verdict(optax.adamw(1e-2), state))
