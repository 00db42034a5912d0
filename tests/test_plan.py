"""`fs.plan` against what actually happens: the compiled step's collectives (read from its
HLO) and the bytes the sharded arrays occupy on each device."""

import functools
import importlib
import re
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import _parser as hlo
from _hlo import compiled
from conftest import mesh_for
from jax.sharding import AxisType, Mesh

import funshard as fs

LAYERS = 2
UNITS = {f"layer{i}": ("layers", i) for i in range(LAYERS)}
BF16 = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def _params():
    """Layers as units; an embedding (13 rows: padded on 8 or 4 shards), a head and a 0-d
    scale left to the root."""
    k = jax.random.split(jax.random.key(0), LAYERS + 2)
    return {
        "embed": jax.random.normal(k[0], (13, 24)),
        "layers": [
            {"w": jax.random.normal(k[i + 1], (24, 24)) / 5, "b": jnp.zeros(24)}
            for i in range(LAYERS)
        ],
        "head": jax.random.normal(k[-1], (24, 5)),
        "scale": jnp.float32(1.0),
    }


def _step(reshard, **options):
    """The step `fs.plan(..., units=UNITS)` describes: one unit per layer, the root's
    leaves gathered by one fs.unshard."""
    layers = [
        fs.fully_shard(
            lambda p, h: jnp.tanh(h @ p["w"] + p["b"]),
            reshard_after_forward=reshard.get(f"layer{i}", True),
            name=f"layer{i}",
        )
        for i in range(LAYERS)
    ]

    def loss(state, batch):
        x, y = batch
        root = fs.unshard({"embed": state["embed"], "head": state["head"]})
        h = jnp.tanh(x @ root["embed"])
        for layer, p in zip(layers, state["layers"], strict=True):
            h = layer(p, h)
        return jnp.mean(((h @ root["head"]).astype(jnp.float32) * state["scale"] - y) ** 2)

    return fs.value_and_grad(loss, **options)


def _executed(text: str, layers: int | None = None) -> dict:
    """Per collective kind, the (group size, buffer bytes) of every execution in one
    step, from the compiled HLO (ops inside the microbatch loop count once per trip).

    With `layers`, the step scans a stack of that many layers, whose loops prefetch
    the next layer's gather in a conditional that runs on every trip but the last.
    """
    ops, facts = hlo.executed_collectives(text, 8)
    assert not facts["unknown_trip"]
    for op in ops:
        if op["conditional"]:
            assert layers and op["kind"] == "all-gather" and op["times"] % layers == 0, op
            op["times"] = op["times"] // layers * (layers - 1)
    return {
        kind: Counter(
            [
                (op["group"], op["bytes"])
                for op in ops
                if op["kind"] == kind
                for _ in range(op["times"])
            ]
        )
        for kind in KINDS
    }


def _planned(plan, kind: str) -> Counter:
    return Counter(
        [(c.group, c.bytes) for c in plan.collectives if c.kind == kind for _ in range(c.times)]
    )


def _split_mesh():
    """8 devices with two shard axes, for hpZ groups of 4 (FSDP2's int reshard)."""
    devices = np.array(jax.devices()).reshape(2, 4)
    return Mesh(devices, ("fsdp_outer", "fsdp_inner"), axis_types=(AxisType.Auto,) * 2)


CASES = {
    "fsdp": dict(mesh="8"),
    "keep-bf16": dict(mesh="8", policy=BF16, reshard=False),
    "hsdp-bf16-microbatches": dict(mesh="2x4", policy=BF16, microbatches=2),
    # Gathers not tied to a microbatch (the root's, a unit that keeps its parameters)
    # run once per step: XLA hoists them out of the microbatch loop.
    "microbatches-one-unit-keeps": dict(mesh="8", microbatches=2, reshard={"layer1": False}),
    "hsdp-no-sync": dict(mesh="2x4", microbatches=2, sync_every_microbatch=False),
    "hsdp-frozen-all-reduce-at-end": dict(
        mesh="2x4",
        microbatches=2,
        all_reduce_every_microbatch=False,
        trainable={"embed": True, "layers": [True, False], "head": False, "scale": True},
    ),
    "hpz": dict(mesh="split", shard_axis=("fsdp_outer", "fsdp_inner"), reshard=4),
}
BATCH = (jnp.ones((16, 13)), jnp.ones((16, 5)))


@functools.cache
def _compiled_case(case: str):
    """(compiled HLO text, the plan's keyword arguments) of one case, compiled once."""
    spec = dict(CASES[case])
    name, policy = spec.pop("mesh"), spec.pop("policy", None)
    mesh = _split_mesh() if name == "split" else mesh_for(name)
    layout = dict(mp_policy=policy)
    if "shard_axis" in spec:
        layout["shard_axis"] = spec.pop("shard_axis")
    reshard = spec.pop("reshard", True)
    by_unit = reshard if isinstance(reshard, dict) else dict.fromkeys(UNITS, reshard)
    state = fs.shard(_params(), mesh, **layout)
    _, text = compiled(_step(by_unit, **spec), state, BATCH)
    return text, dict(mesh=mesh, reshard_after_forward=reshard, **layout, **spec)


@pytest.mark.parametrize("case", CASES)
def test_collectives_match_the_compiled_step(case):
    text, options = _compiled_case(case)
    measured = _executed(text)
    planned = fs.plan(_params(), units=UNITS, **options)
    for kind in ("all-gather", "reduce-scatter"):
        assert _planned(planned, kind) == measured[kind], (kind, planned.collectives)
        assert planned.count(kind) == sum(measured[kind].values())
    # XLA combines all-reduces into tuples, so only their bytes are comparable.
    assert planned.bytes("all-reduce") == _bytes(measured["all-reduce"]), planned.collectives
    assert planned.count("all-gather") > 0 and planned.bytes("reduce-scatter") > 0


def _bytes(executions: Counter) -> int:
    return sum(size * times for (_, size), times in executions.items())


@pytest.mark.parametrize("mesh_name,policy", [("8", None), ("2x4", BF16), ("4", None)])
def test_memory_matches_the_sharded_arrays(mesh_name, policy):
    mesh, opt = mesh_for(mesh_name), optax.adamw(1e-3)
    params = _params()
    state = fs.shard(params, mesh, mp_policy=policy)
    opt_state = fs.init_optimizer(opt, state)
    planned = fs.plan(params, mesh, units=UNITS, mp_policy=policy, optimizer=opt)
    devices = set(mesh.devices.flat)
    held = lambda tree: {  # noqa: E731
        sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(tree)
            for s in leaf.addressable_shards
            if s.device == d
        )
        for d in devices
    }
    assert held(state) == {planned.params.per_device}
    assert held(opt_state) == {planned.optimizer.per_device}
    assert planned.params.replicated == sum(x.nbytes for x in jax.tree.leaves(params))
    full_opt = opt.init(params)
    assert planned.optimizer.replicated == sum(x.nbytes for x in jax.tree.leaves(full_opt))
    assert planned.grads == planned.params
    assert sum(u.param_bytes for u in planned.units) == planned.params.per_device
    # Sharding must actually save something here, or the comparison proves little.
    assert planned.params.per_device < planned.params.replicated / 2


def test_gradients_match_the_step_output():
    state = fs.shard(_params(), mesh_for("8"))
    grads = jax.eval_shape(_step({}), state, BATCH)[1]
    planned = fs.plan(state, units=UNITS)
    held = sum(
        np.prod(x.data.sharding.shard_shape(x.data.shape)) * x.data.dtype.itemsize
        if isinstance(x, fs.Sharded)
        else np.prod(x.shape) * x.dtype.itemsize
        for x in jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, fs.Sharded))
    )
    assert held == planned.grads.per_device


def test_gathered_bytes_per_unit_are_the_units_all_gather():
    """Each unit's gathered bytes are its own all-gather in the compiled program (read
    from the collective's scope name), padding included, in param_dtype."""
    text, options = _compiled_case("hsdp-bf16-microbatches")
    planned = fs.plan(_params(), units=UNITS, **options)
    for name in UNITS:
        lines = [
            ln
            for ln in text.splitlines()
            if f"funshard/{name}/all_gather" in ln and " all-gather(" in ln
        ]
        sizes = {c.nbytes for c in hlo.parse_collectives(lines)}
        assert sizes == {planned.unit(name).gathered_bytes}, (name, sizes)
    # 24 x 24 + 24 bf16 values over 4 shards: 6 rows of w and of b each; 13 rows of
    # the embedding padded to 16.
    assert planned.unit("layer0").gathered_bytes == 4 * (6 * 24 + 6) * 2
    assert planned.unit("root").gathered_bytes == 4 * (4 * 24 + 6 * 5) * 2


# A stack of layers run by fs.lax_scan / fs.scan: one unit, gathered and reduced one
# layer at a time (each collective one layer's, run once per layer and microbatch).
STACK = 3


def _stacked_params():
    """The stack (with a per-layer gain, replicated) beside a root embedding and head."""
    k = jax.random.split(jax.random.key(1), 3)
    return {
        "embed": jax.random.normal(k[0], (13, 24)),
        "blocks": {
            "w": jax.random.normal(k[1], (STACK, 24, 24)) / 5,
            "b": jnp.zeros((STACK, 24)),
            "gain": jnp.linspace(0.5, 1.5, STACK),
        },
        "head": jax.random.normal(k[2], (24, 5)),
    }


def _stacked_state(mesh, policy=None):
    params = _stacked_params()
    ends = {"embed": params["embed"], "head": params["head"]}
    return {
        **fs.shard(ends, mesh, mp_policy=policy),
        "blocks": fs.shard(params["blocks"], mesh, stacked=True, mp_policy=policy),
    }


def _block(h, p):
    return _layer(p, h), None


def _layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"]) * p["gain"]


def _scanned_step(scan, reshard, **options):
    def loss(state, batch):
        x, y = batch
        root = fs.unshard({"embed": state["embed"], "head": state["head"]})
        h = jnp.tanh(x @ root["embed"])
        if scan == "lax_scan":
            h = fs.lax_scan(_block, h, state["blocks"], reshard_after_forward=reshard)[0]
        else:
            h = fs.scan(_layer, state["blocks"], h, reshard_after_forward=reshard)
        return jnp.mean(((h @ root["head"]).astype(jnp.float32) - y) ** 2)

    return fs.value_and_grad(loss, **options)


SCAN_CASES = {
    "fsdp-microbatches": dict(mesh="8", microbatches=2),
    "keep-layers": dict(mesh="8", reshard=False, microbatches=2),
    "hsdp-bf16-fs-scan": dict(mesh="2x4", policy=BF16, microbatches=2, scan="scan"),
    "hsdp-all-reduce-at-end": dict(mesh="2x4", microbatches=2, all_reduce_every_microbatch=False),
}


@functools.cache
def _compiled_scan_case(case: str):
    spec = dict(SCAN_CASES[case])
    mesh, policy = mesh_for(spec.pop("mesh")), spec.pop("policy", None)
    scan, reshard = spec.pop("scan", "lax_scan"), spec.pop("reshard", True)
    state = _stacked_state(mesh, policy)
    _, text = compiled(_scanned_step(scan, reshard, **spec), state, BATCH)
    return text, state, dict(reshard_after_forward=reshard, **spec)


def _widened(plan) -> int:
    """All-reduce bytes per step as XLA CPU runs them: 16-bit ones widened to f32."""
    return sum(
        c.total_bytes * (2 if np.dtype(c.dtype).itemsize == 2 else 1)
        for c in plan.collectives
        if c.kind == "all-reduce"
    )


@pytest.mark.parametrize("case", SCAN_CASES)
def test_scanned_stack_collectives_match_the_compiled_step(case):
    text, state, options = _compiled_scan_case(case)
    measured = _executed(text, layers=STACK)
    planned = fs.plan(state, units={"blocks": "blocks"}, **options)
    for kind in ("all-gather", "reduce-scatter"):
        assert _planned(planned, kind) == measured[kind], (kind, planned.collectives)
    assert _widened(planned) == _bytes(measured["all-reduce"]), planned.collectives
    blocks = planned.unit("blocks")
    assert blocks.layers == STACK
    microbatches = options["microbatches"]
    gathers = 2 if options["reshard_after_forward"] else 1  # forward, backward re-gather
    assert planned.count("all-gather", "blocks") == gathers * STACK * microbatches
    assert planned.count("reduce-scatter", "blocks") == STACK * microbatches
    # One layer's gather, read from the scan's own collective (named after its function).
    name = "scan/_layer" if "fs-scan" in case else "scan/_block"
    lines = [ln for ln in text.splitlines() if f"funshard/{name}/all_gather" in ln]
    assert {c.nbytes for c in hlo.parse_collectives(lines)} == {blocks.gathered_bytes}


def test_scanned_stack_figures():
    """One layer's figures, worked out by hand: 24 x 24 + 24 values of a layer over 4
    shards (6 rows of w and of b), gathered in bf16 and reduced in f32."""
    state = _stacked_state(mesh_for("2x4"), BF16)
    planned = fs.plan(state, units={"blocks": "blocks"}, microbatches=2)
    blocks = planned.unit("blocks")
    assert blocks.gathered_bytes == 4 * (6 * 24 + 6) * 2
    assert blocks.reduce_scatter_bytes == 4 * (6 * 24 + 6) * 4
    # Parameters per device: every layer's block, and the replicated gains whole.
    assert blocks.param_bytes == STACK * (6 * 24 + 6) * 4 + STACK * 4
    held = {
        sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(state["blocks"])
            for s in leaf.addressable_shards
            if s.device == d
        )
        for d in mesh_for("2x4").devices.flat
    }
    assert held == {blocks.param_bytes}
    text = str(planned)
    assert "one layer's for a stack" in text
    header = next(ln for ln in text.splitlines() if ln.split()[:1] == ["unit"])
    row = next(ln for ln in text.splitlines() if ln.split()[:1] == ["blocks"])
    assert header.split()[3] == "layers" and row.split()[3] == str(STACK)
    # A plan without a stack keeps its table as it was.
    assert "layers" not in str(fs.plan(_params(), mesh_for("8"), units=UNITS))


def test_plan_is_the_same_for_arrays_abstract_params_and_a_sharded_state():
    mesh, opt = mesh_for("2x4"), optax.adam(1e-3)
    params = _params()
    from_arrays = fs.plan(params, mesh, units=UNITS, mp_policy=BF16, optimizer=opt)
    abstract = jax.eval_shape(_params)
    assert fs.plan(abstract, mesh, units=UNITS, mp_policy=BF16, optimizer=opt) == from_arrays
    state = fs.shard(params, mesh, mp_policy=BF16)
    assert fs.plan(state, units=UNITS, optimizer=opt) == from_arrays
    assert fs.plan(state, mesh, units=UNITS, optimizer=opt) == from_arrays
    abstract_state = jax.eval_shape(lambda p: fs.shard(p, mesh, mp_policy=BF16), params)
    assert fs.plan(abstract_state, units=UNITS, optimizer=opt) == from_arrays


def test_prefix_forms_select_the_same_unit():
    mesh = mesh_for("8")
    forms = [
        {"a": ("layers", 0), "b": ("layers", 1)},
        {"a": "layers.0", "b": "layers.1"},
        {"a": "['layers'][0]", "b": "['layers'][1]"},
        {"a": [("layers", 0)], "b": ["layers.1"]},
    ]
    plans = [fs.plan(_params(), mesh, units=u) for u in forms]
    assert all(p == plans[0] for p in plans)
    assert plans[0].unit("a").leaves == ("['layers'][0]['b']", "['layers'][0]['w']")
    # A list of prefixes names each unit after its prefix.
    listed = fs.plan(_params(), mesh, units=["layers.0", ("layers", 1)])
    assert [u.name for u in listed.units] == ["layers.0", "layers.1", "root"]
    # Several subtrees in one unit (FSDP2's fully_shard([emb, head])): one gather.
    tied = fs.plan(_params(), mesh, units={"ends": ["embed", "head"]})
    assert tied.unit("ends").gathered_bytes == 8 * (2 * 24 + 3 * 5) * 4
    assert "embed" not in " ".join(tied.unit("root").leaves)


def test_leaves_kept_whole_are_all_reduced_in_the_units_dtype():
    """Leaves kept whole (0-d, or placed fs.Replicate()) get their gradients all-reduced
    by autodiff, in the dtype their unit computes with. Read from the program funshard
    emits (StableHLO): XLA CPU widens 16-bit all-reduces to f32 only afterwards."""
    mesh = mesh_for("8")
    options = dict(
        mp_policy=BF16, placement=lambda path, x: fs.Replicate() if x.ndim == 1 else None
    )
    state = fs.shard(_params(), mesh, **options)
    lowered = jax.jit(_step({})).lower(state, BATCH).as_text()
    measured = Counter()
    for operands in re.findall(r"stablehlo\.all_reduce.*?\}\) : \(([^)]*)\)", lowered, re.DOTALL):
        for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", operands):
            dtype = {"f32": "float32", "bf16": "bfloat16"}[dtype]
            size = np.prod([int(d) for d in dims.split("x") if d], dtype=int)
            measured[dtype] += int(size) * np.dtype(dtype).itemsize
    planned = fs.plan(_params(), mesh, units=UNITS, **options)
    by_dtype = Counter()
    for c in planned.collectives:
        if c.kind == "all-reduce":
            by_dtype[c.dtype] += c.total_bytes
    assert by_dtype == measured
    # Each layer's bias (24 values) in bf16; the 0-d scale and the loss in f32.
    assert measured == {"bfloat16": LAYERS * 24 * 2, "float32": 8}


def test_nested_prefixes_go_to_the_innermost_unit():
    """As FSDP2's (and fs.flax's) units: the model's own unit owns what no inner unit does."""
    planned = fs.plan(_params(), mesh_for("8"), units={"model": "", "layer0": "layers.0"})
    assert [u.name for u in planned.units] == ["model", "layer0"]  # no root left
    assert planned.unit("layer0").leaves == ("['layers'][0]['b']", "['layers'][0]['w']")
    assert "['layers'][1]['w']" in planned.unit("model").leaves
    assert not any("['layers'][0]" in leaf for leaf in planned.unit("model").leaves)
    emptied = fs.plan(
        _params(), mesh_for("8"), units={"all": "layers", "a": "layers.0", "b": "layers.1"}
    )
    assert emptied.unit("all").leaves == () and emptied.count(unit="all") == 0


def test_flax_nnx_state_paths():
    from flax import nnx  # the dev extra installs flax

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
            self.head = nnx.Linear(16, 4, rngs=rngs)

    params = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))), nnx.Param)
    planned = fs.plan(params, mesh_for("8"), units={"block0": "blocks.0", "block1": "blocks.1"})
    assert planned.unit("block0").leaves == (
        "['blocks'][0]['bias'].value",
        "['blocks'][0]['kernel'].value",
    )
    assert planned.unit("block0").gathered_bytes == (16 * 16 + 16) * 4
    assert planned.unit("root").replicated_bytes == (16 * 4 + 4) * 4


def test_no_units_gathers_everything_at_the_root():
    state, batch = fs.shard(_params(), mesh_for("8")), BATCH

    def loss(state, batch):
        p = fs.unshard(state)
        h = jnp.tanh(batch[0] @ p["embed"])
        for layer in p["layers"]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h @ p["head"] * p["scale"] - batch[1]) ** 2)

    measured = _executed(compiled(fs.value_and_grad(loss), state, batch)[1])
    planned = fs.plan(state)
    assert [u.name for u in planned.units] == ["root"]
    for kind in ("all-gather", "reduce-scatter"):
        assert _planned(planned, kind) == measured[kind], kind
    assert planned.bytes("all-reduce") == _bytes(measured["all-reduce"])


def test_accumulators_without_sync():
    planned = fs.plan(
        _params(),
        mesh_for("8"),
        units=UNITS,
        mp_policy=BF16,
        microbatches=4,
        sync_every_microbatch=False,
    )
    full_f32 = sum(x.nbytes for x in jax.tree.leaves(_params()) if x.ndim)
    assert planned.accumulators.per_device == full_f32
    assert planned.count("reduce-scatter") == 1  # one deferred reduce-scatter of everything
    assert fs.plan(_params(), mesh_for("8"), units=UNITS).accumulators is None


def test_printing():
    planned = fs.plan(
        _params(), mesh_for("2x4"), units=UNITS, optimizer=optax.adam(1e-3), microbatches=2
    )
    text = str(planned)
    assert "mesh (replicate=2, fsdp=4), 4 shards x 2 replicas, 2 microbatches" in text
    for fragment in (
        "parameters",
        "optimizer state",
        "layer1",
        "root",
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "KiB",
    ):
        assert fragment in text, fragment
    shown_by_ipython = []
    printer = type("Printer", (), {"text": lambda self, t: shown_by_ipython.append(t)})()
    planned._repr_pretty_(printer, False)
    assert shown_by_ipython == [text]
    from rich.console import Console  # the dev extra installs rich

    console = Console(record=True, width=120)
    console.print(planned)
    shown = console.export_text()
    assert "layer1" in shown and "optimizer state" in shown and "sent/device" in shown


def test_printing_needs_no_rich(monkeypatch):
    """rich is optional: the plan's module imports and prints without it."""
    for name in ("rich", "rich.console", "rich.table", "rich.text"):
        monkeypatch.setitem(sys.modules, name, None)  # `import rich` now raises
    render = importlib.reload(importlib.import_module("funshard.planning._render"))
    planned = fs.plan(_params(), mesh_for("8"), units=UNITS)
    assert render.render_text(planned) == str(planned)
    with pytest.raises(ImportError):
        planned.__rich__()


# --- errors -------------------------------------------------------------------------------


def _raises(exc_type, call, *fragments):
    with pytest.raises(exc_type) as info:
        call()
    message = str(info.value)
    assert message.startswith("plan:"), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize(
    "units,exc_type,fragments",
    [
        ({"layer9": ("layers", 9)}, ValueError, ["'layer9'", "layers holds '0', '1'."]),
        ({"x": "blocks.0"}, ValueError, ["'blocks.0'", "params holds 'embed', 'head', 'layers'"]),
        (
            {"a": "layers.1", "b": ("layers", 1)},
            ValueError,
            ["['layers'][1]['b']", "units 'a' and 'b'", "same prefix"],
        ),
        ({"a": 3.5}, TypeError, ["unit 'a' selects 3.5", "('layers', 0)"]),
        ({"a": []}, TypeError, ["unit 'a'", "non-empty list"]),
        ({"a": "layers..0"}, TypeError, ["'layers..0'"]),
        ("layers.0", TypeError, ["units must be a mapping", "got str"]),
        ({"root": "layers.0"}, ValueError, ["other than 'root'"]),
        ({"": "layers.0"}, TypeError, ["non-empty strings"]),
        ({"s": "scale"}, ValueError, ["unit 's' holds no sharded parameter", "['scale']"]),
        (["layers.0", "layers.0"], ValueError, ["lists 'layers.0' twice"]),
        ([""], TypeError, ["non-empty strings", "name the unit"]),
    ],
)
def test_bad_units(units, exc_type, fragments):
    _raises(exc_type, lambda: fs.plan(_params(), mesh_for("8"), units=units), *fragments)


def test_bad_inputs():
    mesh, params = mesh_for("8"), _params()
    state = fs.shard(params, mesh)
    _raises(TypeError, lambda: fs.plan(params), "fs.plan(params, mesh")
    _raises(
        ValueError, lambda: fs.plan(state, mp_policy=BF16), "already sharded", "drop mp_policy="
    )
    _raises(ValueError, lambda: fs.plan(state, min_shard_size=4), "min_shard_size")
    _raises(ValueError, lambda: fs.plan(state, mesh_for("4")), "leave mesh out")
    bad = {**params, "names": np.array(["a", "b"])}
    _raises(TypeError, lambda: fs.plan(bad, mesh), "leaf ['names']", "<U1")
    _raises(TypeError, lambda: fs.plan(params, mesh, mp_policy="bf16"), "MixedPrecisionPolicy")
    _raises(ValueError, lambda: fs.plan(params, mesh, shard_axis="nope"), "'nope'")
    _raises(ValueError, lambda: fs.plan({"s": jnp.float32(1)}, mesh), "no array leaf")
    _raises(ValueError, lambda: fs.plan(params, mesh, microbatches=0), "microbatches")
    _raises(
        TypeError,
        lambda: fs.plan(params, mesh, sync_every_microbatch=None),
        "sync_every_microbatch must be a bool",
    )
    _raises(
        ValueError,
        lambda: fs.plan(params, mesh, units=UNITS, reshard_after_forward={"layer7": False}),
        "['layer7']",
        "'layer0'",
    )
    _raises(
        ValueError,
        lambda: fs.plan(params, mesh, units=UNITS, reshard_after_forward=3),
        "must divide the number of shards (8)",
    )
    _raises(
        TypeError,
        lambda: fs.plan(params, mesh, reshard_after_forward="yes"),
        "reshard_after_forward must be",
    )
    _raises(
        TypeError,
        lambda: fs.plan(params, mesh, optimizer=optax.adam),
        "GradientTransformation",
        "function",
    )
    _raises(
        ValueError,
        lambda: fs.plan(params, mesh, trainable={"nope": False}),
        "`trainable` must be a pytree prefix",
    )


def test_stacks_the_step_cannot_scan_are_refused():
    """A stack is planned as fs.scan / fs.lax_scan run it: refused where they refuse,
    and where the plan could only guess (a stack left to the root, or mixed in a unit)."""
    state = _stacked_state(mesh_for("8"))
    whole = {"blocks": "blocks"}
    _raises(
        ValueError,
        lambda: fs.plan(state),
        "['blocks']['b'], ['blocks']['w'] are stacked layers",
        "units={'blocks': 'blocks'}",
    )
    _raises(
        ValueError,
        lambda: fs.plan(state, units={"model": ""}),
        "unit 'model' holds stacked layers (['blocks']['b'], ['blocks']['w'])",
        "sharded otherwise (['embed'], ['head'])",
    )
    uneven = {
        **state,
        "blocks": {
            **state["blocks"],
            "b": fs.shard(jnp.zeros((2, 24)), mesh_for("8"), stacked=True),
        },
    }
    _raises(
        ValueError,
        lambda: fs.plan(uneven, units=whole),
        "disagree on the number of layers",
        "['blocks']['b'] (2, 24)",
    )
    for options, option in (
        (dict(reshard_after_forward=4), "reshard_after_forward=4"),
        (dict(microbatches=2, sync_every_microbatch=False), "sync_every_microbatch=False"),
    ):
        _raises(
            NotImplementedError,
            lambda options=options: fs.plan(state, units=whole, **options),
            "unit 'blocks' is a stack of layers",
            option,
        )
        reshard = options.get("reshard_after_forward", True)
        step_options = {k: v for k, v in options.items() if k != "reshard_after_forward"}
        with pytest.raises(NotImplementedError):  # the step refuses the same
            jax.eval_shape(_scanned_step("lax_scan", reshard, **step_options), state, BATCH)


def test_unit_taking_a_child_units_state_first_still_gathers_every_microbatch():
    # The forward gather waits for a value of this microbatch, never for another unit's
    # sharded parameters passed through: either argument order compiles to the same
    # gathers, and the outer unit gathers in every microbatch (forward and backward).
    mesh = mesh_for("8")
    inner = fs.fully_shard(lambda p, h: jnp.tanh(h @ p["w"]), name="inner")

    def outer_child_first(p, child, h):
        return inner(child, jnp.tanh(h @ p["w"]))

    def outer_child_last(p, h, child):
        return inner(child, jnp.tanh(h @ p["w"]))

    params = {"outer": {"w": jnp.eye(24) / 2}, "inner": {"w": jnp.eye(24) / 3}}
    state = fs.shard(params, mesh)
    batch = (jnp.ones((16, 24)), jnp.zeros((16, 24)))
    executed = []
    for body, child_first in ((outer_child_first, True), (outer_child_last, False)):
        outer = fs.fully_shard(body, name="outer")

        def loss(s, b, outer=outer, child_first=child_first):
            args = (s["inner"], b[0]) if child_first else (b[0], s["inner"])
            return jnp.mean((outer(s["outer"], *args) - b[1]) ** 2)

        _, text = compiled(fs.value_and_grad(loss, microbatches=2), state, batch)
        executed.append(_executed(text)["all-gather"])
    assert executed[0] == executed[1]
    # Per microbatch: both forward gathers and the inner re-gather (the outer backward
    # needs no weights: its input is the batch, so XLA drops that re-gather).
    assert sum(executed[0].values()) == 6
