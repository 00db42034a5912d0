"""Every example runs as a user runs it: a subprocess from the command line, a few steps.

`examples/train_lm.py` (the main job) is checked on what it prints and writes: the
logged losses are finite and fall, the summary's memory and collective counts are those
of FSDP (or HSDP), a rerun with the same run folder resumes from the last checkpoint
with the run's own settings, the loss plot is a PNG, and a sample continues the prompt.
Its readouts are checked too: the JSONL rows' step time, tokens/s, MFU, learning rate
(against the schedule written out here), gradient norm (against plain JAX on one
device) and peak memory, the progress line, and the `--profile` trace. Its model
parallelism is checked against its own plain run: `--tensor 2` (alone and with
`--replicate 2`) logs the losses and gradient norms of `--tensor 1`, the top-2 mixture
of experts split over `expert` and `tensor` those of its dense evaluation on every
device, and a checkpoint resumes at another split. `examples/quickstart.py` must train
too. (`examples/train_torch.py` needs torchrun:
tests/test_train_torch.py. train_lm.py's flag checks and run-folder rules run
in-process in tests/test_train_lm.py.)
"""

import gzip
import importlib.util
import json
import math
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from _launch import cache_env, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIMEOUT_S = 300
LOGGED = re.compile(r"^step\s+(\d+)\s+train (\S+)\s+val (\S+)", re.M)
TINY_DEPTH = 2  # train_lm.py's --tiny model
BATCH = 24  # divides over 8 devices and over 3


def run_example(script: str, *args: str, cwd: Path) -> str:
    """Runs `examples/<script>` with `args`; returns its output, failing with it on error."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", **cache_env()}
    proc = run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def logged(out: str) -> list[tuple[int, float, float]]:
    """The (step, train loss, validation loss) lines train_lm.py printed."""
    return [(int(s), float(t), float(v)) for s, t, v in LOGGED.findall(out)]


def summary_value(out: str, row: str) -> str:
    """The 'this run' cell of a row of train_lm.py's summary table."""
    match = re.search(rf"{re.escape(row)}\s*│\s*([^│]*?)\s*│", out)
    assert match, f"no {row!r} row in:\n{out}"
    return match.group(1)


def assert_learns(lines, steps):
    assert [s for s, _, _ in lines] == steps
    assert all(math.isfinite(x) for _, t, v in lines for x in (t, v))
    (_, train0, val0), (_, train1, val1) = lines[0], lines[-1]
    assert train1 < train0 and val1 < val0, lines


def assert_png(path: Path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TINY = ["--tiny", "--eval-every", "4", "--checkpoint-every", "4", "--batch", str(BATCH)]
PEAK_TFLOPS = 0.5


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """8 steps of FSDP on 8 devices with warm-up, clipping, MFU against a peak and a
    profile; then the same run folder again, to step 12, on an HSDP mesh with bf16
    all-gathers (the checkpoint is resharded on load, the other settings are the run
    folder's), with a sample."""
    cwd = tmp_path_factory.mktemp("train_lm")
    run_dir = cwd / "run"
    first = run_example(
        "train_lm.py",
        *TINY,
        "--steps",
        "8",
        "--warmup",
        "2",
        "--clip",
        "1",
        "--peak-tflops",
        str(PEAK_TFLOPS),
        "--profile",
        str(cwd / "profile"),
        "--sample",
        "",
        "--run-dir",
        str(run_dir),
        cwd=cwd,
    )
    second = run_example(
        "train_lm.py",
        "--steps",
        "12",
        "--replicate",
        "2",
        "--param-dtype",
        "bf16",
        "--sample",
        "ROMEO:",
        "--sample-length",
        "40",
        "--run-dir",
        str(run_dir),
        cwd=cwd,
    )
    return first, second, run_dir


@pytest.fixture(scope="module")
def scan_run(tmp_path_factory):
    """8 steps with `--scan` on 3 devices (every leaf padded) and another seed."""
    cwd = tmp_path_factory.mktemp("train_lm_scan")
    out = run_example(
        "train_lm.py",
        *TINY,
        "--steps",
        "8",
        "--scan",
        "--devices",
        "3",
        "--seed",
        "1",
        "--sample",
        "",
        "--run-dir",
        str(cwd / "run"),
        cwd=cwd,
    )
    return out, cwd / "run"


def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run folder's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_lm_fsdp_learns_and_reports(fsdp_run):
    out, _, run_dir = fsdp_run
    assert "mesh {'fsdp': 8}" in out
    assert_learns(logged(out), [4, 8])
    assert summary_value(out, "parameters per device").endswith("KiB")
    assert "(1/8.0)" in out  # 8 shards of every parameter and moment
    # Each block is a unit: gathered for forward and again for backward; the root
    # (embeddings, head) once; one reduce-scatter per unit; the loss's all-reduce
    # (XLA folds the gradient norm's into it).
    assert summary_value(out, "all-gathers per step") == str(1 + 2 * TINY_DEPTH)
    assert summary_value(out, "reduce-scatters per step") == str(1 + TINY_DEPTH)
    assert summary_value(out, "all-reduces per step") == "1"
    # fs.check ran on the compiled step before training, and found it as declared.
    assert "fs.check: ✓ the compiled step's collectives match the policy" in out
    assert summary_value(out, "collectives against policy") == "✓"
    assert_png(run_dir / "loss.png")
    saved = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert {"step_000004", "step_000008"} <= saved


def test_train_lm_resumes_on_another_mesh_and_samples(fsdp_run):
    first, second, run_dir = fsdp_run
    assert re.search(r"resumed at step 8 from \S+step_000008$", second, re.M)
    assert "mesh {'replicate': 2, 'fsdp': 4}" in second
    for change in ("--steps 12 (was 8)", "--replicate 2 (was 1)", "--param-dtype bf16 (was f32)"):
        assert f"resuming with {change}" in second
    assert [s for s, _, _ in logged(second)] == [12]  # steps 9..12 only
    rows = metrics(run_dir)
    assert [r["step"] for r in rows if "val" in r] == [4, 8, 12]
    assert rows[-1]["val"] < logged(first)[0][2]
    assert (run_dir / "checkpoints" / "step_000012").is_dir()
    assert "(1/4.0)" in second  # HSDP: sharded over 4 devices, replicated over 2 groups
    # HSDP all-reduces each scattered gradient over the replicas too.
    assert int(summary_value(second, "all-reduces per step")) > 1
    sample = second.split("sample:\n", 1)[1].split("\nwall time", 1)[0]
    assert sample.startswith("ROMEO:") and len(sample) > len("ROMEO:") + 10
    # The settings not given again are the run folder's, not the defaults.
    config = json.loads((run_dir / "config.json").read_text())["settings"]
    assert (config["batch"], config["warmup"], config["clip"], config["steps"]) == (BATCH, 2, 1, 12)


def cosine_lr(update: int, *, peak: float, warmup: int, steps: int) -> float:
    """Linear warm-up from 0, then cosine decay to peak / 10 at `steps` (update 0-based)."""
    if update < warmup:
        return peak * update / warmup
    progress = (update - warmup) / (steps - warmup)
    return peak / 10 + (peak - peak / 10) * 0.5 * (1 + math.cos(math.pi * progress))


def test_train_lm_logs_the_schedules_learning_rate(fsdp_run):
    rows = [r for r in metrics(fsdp_run[2]) if "loss" in r]
    # Logged: the first step of each invocation, every 10th, evaluations, checkpoints.
    assert [r["step"] for r in rows] == [1, 4, 8, 9, 10, 12]
    for r in rows:
        steps = 8 if r["step"] <= 8 else 12  # the resume stretched the schedule to 12
        expected = cosine_lr(r["step"] - 1, peak=5e-3, warmup=2, steps=steps)
        assert r["lr"] == pytest.approx(expected, rel=1e-5, abs=1e-9), r
    assert "the cosine schedule now ends at step 12" in fsdp_run[1]


def test_train_lm_reports_speed_mfu_and_memory(fsdp_run):
    out, _, run_dir = fsdp_run
    flops = float(
        re.search(r"^([\d,]+) FLOPs per step per device", out, re.M).group(1).replace(",", "")
    )
    # XLA's count for one device's share, not the whole mesh's: about 6 FLOPs per
    # parameter per token (forward and backward), BATCH * 32 / 8 tokens per device.
    params = 8 * 1024 * float(summary_value(out, "parameters per device").split()[0]) / 4
    assert 0.5 < flops / (6 * params * BATCH * 32 / 8) < 2
    state_bytes = sum(
        1024 * float(summary_value(out, f"{n} per device").split()[0])
        for n in ("parameters", "optimizer state")
    )
    rows = [r for r in metrics(run_dir) if "loss" in r and r["step"] <= 8]
    assert sum(r["window"] for r in rows) == 8
    wall = float(summary_value(out, "wall time").split()[0])
    assert 0 < sum(r["step_time_s"] * r["window"] for r in rows) < wall
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(BATCH * 32 / r["step_time_s"])
        assert r["tflops_per_device"] == pytest.approx(flops / r["step_time_s"] / 1e12)
        assert r["mfu_percent"] == pytest.approx(100 * r["tflops_per_device"] / PEAK_TFLOPS)
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        # CPU devices report no memory_stats(): the compiled step's own footprint.
        assert r["peak_memory_source"] == "compiled step"
        assert r["peak_memory_bytes"] > state_bytes
    # The progress bar's readouts, also printed at each evaluation:
    line = re.search(
        r"^step +8  train \S+  val \S+  [\d.]+ ms/step  [\d,]+ tok/s  \S+ "
        r"TFLOP/s/device  MFU [\d.]+% \(indicative on CPU\)  gnorm [\d.]+  "
        r"lr \S+  peak mem [\d.]+ [KM]iB/device$",
        out,
        re.M,
    )
    assert line, out
    assert summary_value(out, "MFU").endswith("%")


def test_train_lm_bar_and_table_show_the_same_loss(fsdp_run):
    out, _, run_dir = fsdp_run
    bar = re.search(r"^training .* 8/8 loss (\S+) val", out, re.M).group(1)
    last = next(r for r in metrics(run_dir) if "loss" in r and r["step"] == 8)
    table = re.search(r"train loss, last (\d+) steps\s*│\s*(\S+)", out)
    assert bar == table.group(2) == f"{last['loss']:.3f}"
    assert int(table.group(1)) == last["window"] == 4  # steps 5..8


def test_train_lm_profile_shows_the_units(fsdp_run):
    profile = fsdp_run[2].parent / "profile"
    traces = list(profile.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1
    assert list(traces[0].parent.glob("perfetto_trace.json.gz"))
    # The trace carries the step's HLO, whose instructions are named by unit.
    trace = traces[0].read_bytes()
    for unit in ("Block", "GPT"):
        assert f"funshard/{unit}/all_gather".encode() in trace
        assert f"funshard/{unit}/reduce_scatter".encode() in trace
    assert "funshard/Block/all_gather" in (profile / "train_step.hlo.txt").read_text()
    # ... and the script adds up the trace's time per unit and collective.
    line = fsdp_run[0].split("ms per step and device")[1].splitlines()[0]
    times = dict(re.findall(r"(\w+/\w+) ([\d.]+)", line))
    assert set(times) == {
        f"{unit}/{collective}"
        for unit in ("Block", "GPT")
        for collective in ("all_gather", "reduce_scatter")
    }
    assert all(float(ms) > 0 for ms in times.values())
    # ... and writes the trace again with those spans named by unit, for Perfetto.
    assert f"spans named by unit: {profile / 'funshard_trace.json.gz'}" in fsdp_run[0]
    events = json.loads(gzip.decompress((profile / "funshard_trace.json.gz").read_bytes()))
    spans = [e["name"] for e in events["traceEvents"] if e.get("ph") == "X"]
    for scope in times:
        collective = scope.split("/")[1].replace("_", "[-_]")
        assert any(
            re.fullmatch(rf"funshard/{scope} \({collective}[\w.-]*\)", name) for name in spans
        ), (scope, Counter(spans).most_common(20))


def _load_train_lm():
    if "train_lm" not in sys.modules:  # tests/test_train_lm.py may have loaded it
        spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_lm"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_lm"]


def plain_first_step(seeds) -> list[tuple[float, float]]:
    """(loss, gradient norm) of train_lm's first step per seed, in plain JAX on one device:
    the unsharded tiny GPT from the same initialisation, on the same first batch."""
    from flax import nnx

    train_lm = _load_train_lm()

    @jax.jit
    def first_step(key, batch):
        graphdef, params = nnx.split(train_lm.GPT(train_lm.TINY, rngs=nnx.Rngs(key)))

        def loss(params):
            logits = nnx.merge(graphdef, params)(batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        return value, global_norm(grads)

    data = np.frombuffer(train_lm.DATA.read_bytes(), np.uint8)
    text = data[: int(len(data) * 0.9)]
    results = []
    with jax.default_device(jax.devices()[0]):
        for seed in seeds:
            batch = train_lm.batch_at(text, 0, BATCH, train_lm.TINY.context, seed)
            results.append(tuple(float(x) for x in first_step(jax.random.key(seed), batch)))
    return results


def global_norm(tree):
    """The global L2 norm, written out (not optax's, which train_lm.py uses)."""
    return jax.numpy.sqrt(sum(jax.numpy.sum(jax.numpy.square(x)) for x in jax.tree.leaves(tree)))


def test_train_lm_gradient_norm_is_the_full_gradients(fsdp_run, scan_run):
    # Step 1 of the 8-device run (seed 0) and of the 3-device --scan run (seed 1, every
    # leaf padded) against the unsharded model.
    logged = [
        next(r for r in metrics(run_dir) if r["step"] == 1)
        for run_dir in (fsdp_run[2], scan_run[1])
    ]
    for row, (loss, norm) in zip(logged, plain_first_step([0, 1]), strict=True):
        assert row["window"] == 1
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert logged[0]["loss"] != pytest.approx(logged[1]["loss"], rel=1e-3)  # --seed


def test_train_lm_scan(scan_run):
    out, run_dir = scan_run
    assert "mesh {'fsdp': 3}" in out
    assert_learns(logged(out), [4, 8])
    # 3 shards, padded: a little more than a third of each replicated size per device.
    shares = [float(x) for x in re.findall(r"replicated \(1/([\d.]+)\)", out)]
    assert len(shares) == 2 and all(2.5 < x < 3 for x in shares)
    assert int(summary_value(out, "reduce-scatters per step")) >= 1
    # fs.plan covers the stack: one unit of TINY_DEPTH layers, each layer's gather run
    # in forward and again in backward, its reduce-scatter once (tests/test_plan.py
    # compares such plans with the compiled program).
    size = r"\d+(?:\.\d+)? (?:B|KiB|MiB)"
    row = re.search(
        rf"^\s*blocks\s+\d+\s+True\s+(\d+)\s+{size}\s+{size}\s+(\d+)\s+{size}\s+(\d+)$", out, re.M
    )
    assert row and row.groups() == (str(TINY_DEPTH), str(2 * TINY_DEPTH), str(TINY_DEPTH)), out
    # XLA counts the layer loop's body once: no FLOPs, so no MFU, rather than a wrong one.
    assert "FLOPs and MFU: n/a with --scan" in out
    assert all("mfu_percent" not in r for r in metrics(run_dir))
    assert_png(run_dir / "loss.png")


# ------------------------------------------------------------------ model parallelism

PARALLEL = [
    "--tiny",
    "--batch",
    str(BATCH),
    "--eval-every",
    "10",
    "--checkpoint-every",
    "10",
    "--sample",
    "",
]


def resume_from(run_dir: Path, step: int, copy: Path) -> Path:
    """A copy of `run_dir` as if its run had stopped after `step`: the later checkpoints
    removed (a resume then redoes the later steps, logging them again)."""
    shutil.copytree(run_dir, copy)
    for path in (copy / "checkpoints").iterdir():
        if int(path.name.removeprefix("step_")) > step:
            shutil.rmtree(path)
    return copy


@pytest.fixture(scope="module")
def tensor_runs(tmp_path_factory):
    """`--steps 30` with --tensor 1, --tensor 2 and --tensor 2 --replicate 2; then the
    --tensor 2 run again from its step-10 checkpoint, at --tensor 1."""
    cwd = tmp_path_factory.mktemp("train_lm_tensor")
    splits = {
        "plain": [],
        "tensor": ["--tensor", "2"],
        "hybrid": ["--tensor", "2", "--replicate", "2"],
    }
    outs = {
        name: run_example(
            "train_lm.py", *PARALLEL, "--steps", "30", *flags, "--run-dir", str(cwd / name), cwd=cwd
        )
        for name, flags in splits.items()
    }
    resumed = resume_from(cwd / "tensor", 10, cwd / "resumed")
    outs["resumed"] = run_example(
        "train_lm.py", "--tensor", "1", "--run-dir", str(resumed), cwd=cwd
    )
    return outs, cwd


def by_step(run_dir: Path) -> dict[tuple[int, str], float]:
    """A run folder's logged numbers by (step, name): loss, val, grad_norm."""
    return {
        (r["step"], key): r[key]
        for r in metrics(run_dir)
        for key in ("loss", "val", "grad_norm")
        if key in r
    }


def test_train_lm_tensor_parallel_gives_the_plain_losses(tensor_runs):
    outs, cwd = tensor_runs
    plain = by_step(cwd / "plain")
    assert_learns(logged(outs["plain"]), [10, 20, 30])
    assert len(plain) == 11  # steps 1, 10, 20, 30: loss and gradient norm; 3 validations
    for name, mesh, share in (
        ("tensor", "{'fsdp': 4, 'tensor': 2}", (4, 8)),
        ("hybrid", "{'replicate': 2, 'fsdp': 2, 'tensor': 2}", (2, 4)),
    ):
        out = outs[name]
        assert f"mesh {mesh}" in out
        split = by_step(cwd / name)
        assert split.keys() == plain.keys()
        for key, value in plain.items():
            assert split[key] == pytest.approx(value, rel=1e-5), (name, key)
        # A device holds 1/fsdp of each leaf's tensor-parallel block: between 1/fsdp
        # (were no leaf split over tensor) and 1/(fsdp x tensor) of the model.
        ratios = [float(x) for x in re.findall(r"replicated \(1/([\d.]+)\)", out)]
        assert len(ratios) == 2 and all(share[0] < x < share[1] for x in ratios), ratios
        # The row-parallel projections sum over tensor (twice per block forward, and
        # the gradients of their inputs twice backward): all-reduces the plain run has not.
        extra = int(summary_value(out, "all-reduces per step")) - int(
            summary_value(outs["plain"], "all-reduces per step")
        )
        assert extra >= 4 * TINY_DEPTH, extra
        # FSDP's collectives run over the data axes only and move each leaf's
        # tensor-parallel block: fewer bytes gathered than the plain run's whole leaves.
        assert "collectives per mesh axes" in out  # the plan's table
        gathered = kib(summary_value(out, "all-gather over fsdp"))
        assert 0 < gathered < kib(planned_bytes(outs["plain"], "all-gather"))
        assert kib(summary_value(out, "reduce-scatter over fsdp")) > 0
    assert kib(summary_value(outs["hybrid"], "all-reduce over replicate")) > 0


def kib(size: str) -> float:
    """`12.5 KiB` or `1.2 MiB` (fs.plan's and train_lm's sizes) in KiB."""
    value, unit = size.split()
    return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[unit]


def planned_bytes(out: str, kind: str) -> str:
    """The bytes of `kind` in the printed plan's "collectives per step" table."""
    match = re.search(rf"^\s+{kind}\s+\d+\s+(\S+ [KM]?i?B)\s", out, re.M)
    assert match, out
    return match.group(1)


def test_train_lm_resumes_at_another_tensor_size(tensor_runs):
    outs, cwd = tensor_runs
    out = outs["resumed"]
    assert re.search(r"resumed at step 10 from \S+step_000010$", out, re.M)
    assert "resuming with --tensor 1 (was 2)" in out
    assert "mesh {'fsdp': 8}" in out
    plain, resumed = by_step(cwd / "plain"), by_step(cwd / "resumed")
    # Steps 11..30 again, on 8 FSDP devices: the numbers of the plain run, which never
    # stopped (the row of step 30 averages steps 21..30 in both; that of step 20 starts
    # at step 12 here, as the resume logs step 11 on its own).
    for key in ((20, "grad_norm"), (20, "val"), (30, "loss"), (30, "grad_norm"), (30, "val")):
        assert resumed[key] == pytest.approx(plain[key], rel=1e-5), key
    assert (11, "grad_norm") in resumed


@pytest.fixture(scope="module")
def expert_runs(tmp_path_factory):
    """A top-2 mixture of 4 experts with --scan, 10 steps: evaluated densely on every
    device; split over expert=2 x tensor=2; that run again from its step-5 checkpoint,
    over expert=4 alone."""
    cwd = tmp_path_factory.mktemp("train_lm_experts")
    moe = [*PARALLEL, "--scan", "--experts", "4", "--steps", "10"]
    moe += ["--eval-every", "5", "--checkpoint-every", "5"]
    outs = {"dense": run_example("train_lm.py", *moe, "--run-dir", str(cwd / "dense"), cwd=cwd)}
    outs["split"] = run_example(
        "train_lm.py",
        *moe,
        "--expert-parallel",
        "2",
        "--tensor",
        "2",
        "--run-dir",
        str(cwd / "split"),
        cwd=cwd,
    )
    resumed = resume_from(cwd / "split", 5, cwd / "resumed")
    outs["resumed"] = run_example(
        "train_lm.py", "--expert-parallel", "4", "--tensor", "1", "--run-dir", str(resumed), cwd=cwd
    )
    return outs, cwd


def test_train_lm_expert_parallel_gives_the_dense_losses(expert_runs):
    outs, cwd = expert_runs
    assert "mesh {'fsdp': 8}" in outs["dense"]
    assert "mesh {'fsdp': 2, 'expert': 2, 'tensor': 2}" in outs["split"]
    assert "mesh {'fsdp': 2, 'expert': 4}" in outs["resumed"]
    assert re.search(r"resumed at step 5 from \S+step_000005$", outs["resumed"], re.M)
    # Tokens travel to their experts' devices and back: all-to-alls in the step, none
    # where every device evaluates every expert.
    assert "all-to-alls per step" not in outs["dense"]
    for name in ("split", "resumed"):
        assert int(summary_value(outs[name], "all-to-alls per step")) >= 2
    dense = by_step(cwd / "dense")
    assert dense[10, "val"] < dense[5, "val"] < dense[1, "loss"]
    split, resumed = by_step(cwd / "split"), by_step(cwd / "resumed")
    assert split.keys() == dense.keys()
    for key, value in dense.items():
        assert split[key] == pytest.approx(value, rel=1e-5), key
    # Steps 6..10 again (the resume logs step 6 on its own, so its row of step 10
    # averages steps 7..10: the gradient norm and the validation are compared).
    for key in ((10, "grad_norm"), (10, "val")):
        assert resumed[key] == pytest.approx(dense[key], rel=1e-5), key


def test_train_lm_check_only_prints_the_report_and_trains_nothing(tmp_path):
    out = run_example(
        "train_lm.py", "--tiny", "--check-only", "--run-dir", str(tmp_path / "run"), cwd=tmp_path
    )
    assert "funshard check: mesh (fsdp=8) on cpu: ✓ the compiled step matches its policy" in out
    # Each block a unit: gathered for forward and backward, reduce-scattered once; the
    # root (embeddings, head) gathered once and reduce-scattered once.
    rows = re.findall(r"^  (all-gather|reduce-scatter)\s+(\w+)\s+(\w+)\s.*\s(\d+)\s+ok$", out, re.M)
    assert sorted(rows) == sorted(
        [
            ("all-gather", "Block", "backward", str(TINY_DEPTH)),
            ("all-gather", "Block", "forward", str(TINY_DEPTH)),
            ("reduce-scatter", "Block", "gradients", str(TINY_DEPTH)),
            ("all-gather", "GPT", "forward", "1"),
            ("reduce-scatter", "GPT", "gradients", "1"),
        ]
    )
    assert not LOGGED.search(out)  # no step trained
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_quickstart_learns(tmp_path):
    out = run_example("quickstart.py", "--steps", "41", cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss (\S+)$", out, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert re.search(r"per device: [\d,]+ bytes of parameters", out)


def test_every_example_is_run_by_a_test():
    # Here, or in a test file of its own (examples/train_torch.py needs torchrun:
    # tests/test_train_torch.py). Helper modules (_name.py) are not examples.
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    examples = [p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")]
    assert "train_lm.py" in examples and "quickstart.py" in examples
    assert [name for name in examples if f'"{name}"' not in tests] == []
