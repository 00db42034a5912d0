"""`examples/train_lm.py` in-process: its flag checks, its run-folder settings, its optimizer.

Nothing here compiles a training step: bad flags must be refused before JAX starts, so
each case stops `main` where it would start the devices. What needs a real run (the
readouts, the profile, the gradient norm against plain JAX) is in tests/test_examples.py.
"""

import importlib.util
import json
import signal
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _load_train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


train_lm = _load_train_lm()


class Started(Exception):
    """Raised where `main` would start JAX's devices: every check has passed by then."""


@pytest.fixture
def no_jax(monkeypatch):
    """Stops `main` before it starts JAX's devices; records the settings it got to."""
    reached = []

    def start_devices(parser, count):
        reached.append(count)
        raise Started

    monkeypatch.setattr(train_lm, "start_devices", start_devices)
    monkeypatch.setattr(train_lm, "train", lambda *a: pytest.fail("train() was reached"))
    return reached


def refused(argv, capsys) -> str:
    """Runs `main(argv)`, which must exit as argparse does on a bad flag; returns stderr."""
    with pytest.raises(SystemExit) as exit_:
        train_lm.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


BAD_FLAGS = [
    (["--steps", "-1"], ["--steps -1: must be at least 1"]),
    (["--steps", "0"], ["--steps 0: must be at least 1"]),
    (
        ["--devices", "3"],
        ["--batch 32 is not divisible by --devices 3", "--batch 30 or --batch 33"],
    ),
    (["--devices", "3", "--batch", "8"], ["--batch 8 is not divisible", "--batch 6 or --batch 9"]),
    (["--devices", "16", "--batch", "8"], ["pass --batch 16, or a --devices that divides 8"]),
    (["--replicate", "3"], ["--replicate 3 does not divide --devices 8"]),
    (["--replicate", "0"], ["--replicate 0: must be at least 1"]),
    (["--devices", "0"], ["--devices 0: must be at least 1"]),
    (["--batch", "0"], ["--batch 0: must be at least 1"]),
    (["--lr", "0"], ["--lr 0.0: the learning rate must be a positive number"]),
    (["--lr", "nan"], ["--lr nan"]),
    (["--warmup", "8", "--steps", "8"], ["--warmup 8 must be below --steps 8"]),
    (["--warmup", "-1"], ["--warmup -1: must be at least 0"]),
    (["--clip", "-1"], ["--clip -1.0"]),
    (["--seed", "-1"], ["--seed -1: must be at least 0"]),
    (["--eval-every", "0"], ["--eval-every 0: must be at least 1"]),
    (["--checkpoint-every", "0"], ["--checkpoint-every 0: must be at least 1"]),
    (["--sample-length", "-1"], ["--sample-length -1: must be at least 0"]),
    (["--temperature", "-0.5"], ["--temperature -0.5: must be >= 0"]),
    (["--peak-tflops", "0"], ["--peak-tflops 0.0: must be the device's positive peak"]),
    # Every problem at once, not one per attempt.
    (["--steps", "0", "--lr", "-1"], ["--steps 0", "--lr -1.0"]),
    # Tensor and expert parallelism: the mesh, the model's heads and experts, the batch.
    (["--tensor", "0"], ["--tensor 0: must be at least 1"]),
    (["--expert-parallel", "0"], ["--expert-parallel 0: must be at least 1"]),
    (
        ["--tensor", "3"],
        [
            "--tensor 3 does not divide the model's 4 attention heads",
            "--tensor 3 does not divide --devices 8",
        ],
    ),
    (["--tiny", "--tensor", "4"], ["--tensor 4 does not divide the model's 2 attention heads"]),
    (
        ["--replicate", "2", "--tensor", "2", "--devices", "6", "--batch", "6"],
        ["--replicate 2 x --tensor 2 does not divide --devices 6"],
    ),
    (
        ["--tensor", "2", "--batch", "6"],
        [
            "--batch 6 is not divisible by the data-parallel size 4 (--devices 8 / --tensor 2)",
            "--batch 4 or --batch 8, or a --devices whose data-parallel size divides 6",
        ],
    ),
    (["--experts", "1"], ["--experts 1: each token goes to 2 experts"]),
    (["--expert-parallel", "2"], ["--expert-parallel 2 needs experts to split"]),
    (
        ["--experts", "6", "--expert-parallel", "4"],
        ["--expert-parallel 4 does not divide --experts 6"],
    ),
]


@pytest.mark.parametrize("argv, messages", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_are_refused_before_jax_starts(argv, messages, tmp_path, capsys, no_jax):
    err = refused([*argv, "--run-dir", str(tmp_path / "run")], capsys)
    for message in messages:
        assert message in err
    assert no_jax == [] and not (tmp_path / "run").exists()


def test_good_flags_reach_the_devices(tmp_path, no_jax):
    with pytest.raises(Started):
        train_lm.main(
            [
                "--tiny",
                "--devices",
                "4",
                "--batch",
                "8",
                "--replicate",
                "2",
                "--run-dir",
                str(tmp_path / "run"),
            ]
        )
    assert no_jax == [4]
    # The batch is split over the data-parallel devices only: 8 / 2 here.
    with pytest.raises(Started):
        train_lm.main(
            [
                "--tiny",
                "--batch",
                "4",
                "--tensor",
                "2",
                "--experts",
                "4",
                "--expert-parallel",
                "2",
                "--run-dir",
                str(tmp_path / "run2"),
            ]
        )
    assert no_jax == [4, 8]


@pytest.mark.parametrize("name", ["--profile", "--run-dir"])
def test_folders_must_be_folders(tmp_path, capsys, no_jax, name):
    (tmp_path / "file").write_text("")
    argv = ["--run-dir", str(tmp_path / "run"), name, str(tmp_path / "file")]
    assert f"{name} {tmp_path / 'file'} is a file" in refused(argv, capsys)


# ------------------------------------------------------------------ run-folder settings


def saved_run(path: Path, **settings) -> "train_lm.RunDir":
    """A run folder whose config.json holds `settings` (the rest at their defaults)."""
    settings.setdefault("warmup", train_lm.default_warmup(settings.get("steps", 400)))
    run = train_lm.RunDir(path)
    run.save_settings(train_lm.Settings(**settings), 0, [])
    return run


@pytest.fixture
def trained_with(monkeypatch):
    """Replaces `main`'s training by a record of the settings it would train with."""
    got = []
    monkeypatch.setattr(train_lm, "start_devices", lambda parser, count: None)
    monkeypatch.setattr(train_lm, "train", lambda console, run, settings, *a: got.append(settings))
    return got


def test_every_setting_has_a_resume_rule():
    names = [f.name for f in train_lm.dataclasses.fields(train_lm.Settings)]
    rules = [*train_lm.FIXED, *train_lm.MATCHED, *train_lm.FREE]
    assert sorted(rules) == sorted(names)
    parser_flags = {a.dest for a in train_lm.build_parser()._actions}
    assert set(names) <= parser_flags  # each setting is a flag of the same name


def test_a_new_run_folder_keeps_every_setting(tmp_path, trained_with):
    train_lm.main(
        [
            "--tiny",
            "--steps",
            "20",
            "--lr",
            "0.01",
            "--clip",
            "0.5",
            "--seed",
            "3",
            "--run-dir",
            str(tmp_path),
        ]
    )
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["settings"] == {
        "tiny": True,
        "scan": False,
        "batch": 32,
        "lr": 0.01,
        "seed": 3,
        "warmup": 2,  # the default: an eighth of a short run
        "clip": 0.5,
        "steps": 20,
        "devices": 8,
        "replicate": 1,
        "tensor": 1,
        "experts": 0,
        "expert_parallel": 1,
        "param_dtype": "f32",
        "eval_every": 100,
        "checkpoint_every": 200,
    }
    assert saved["model"] == {"width": 32, "depth": 2, "heads": 2, "context": 32}
    assert trained_with[0] == train_lm.Settings(**saved["settings"])


def test_resume_refuses_changed_settings(tmp_path, capsys, no_jax):
    saved_run(tmp_path, tiny=True, lr=5e-3, batch=32)
    err = refused(["--lr", "0.5", "--batch", "16", "--run-dir", str(tmp_path)], capsys)
    assert "--lr: 0.005 in the run folder, 0.5 now" in err
    assert "--batch: 32 in the run folder, 16 now" in err
    assert "--override" in err
    assert json.loads((tmp_path / "config.json").read_text())["settings"]["lr"] == 5e-3


def test_resume_takes_unset_flags_from_the_run_folder(tmp_path, trained_with):
    saved_run(tmp_path, tiny=True, lr=3e-3, batch=16, warmup=7, clip=1.0, seed=2, steps=50)
    # The same values again, and settings a resume may change: accepted.
    train_lm.main(
        [
            "--lr",
            "0.003",
            "--steps",
            "80",
            "--devices",
            "4",
            "--replicate",
            "2",
            "--tensor",
            "2",
            "--param-dtype",
            "bf16",
            "--run-dir",
            str(tmp_path),
        ]
    )
    got = trained_with[0]
    assert (got.tiny, got.lr, got.batch, got.warmup, got.clip, got.seed) == (
        True,
        3e-3,
        16,
        7,
        1.0,
        2,
    )
    assert (got.steps, got.devices, got.replicate, got.tensor, got.param_dtype) == (
        80,
        4,
        2,
        2,
        "bf16",
    )
    changes = json.loads((tmp_path / "config.json").read_text())["changes"]
    assert {c["change"] for c in changes} >= {"--steps 80 (was 50)", "--devices 4 (was 8)"}


def test_override_changes_a_setting_and_records_it(tmp_path, trained_with, capsys):
    saved_run(tmp_path, tiny=True, lr=5e-3)
    train_lm.main(["--lr", "0.5", "--override", "--run-dir", str(tmp_path)])
    assert trained_with[0].lr == 0.5
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["settings"]["lr"] == 0.5
    assert saved["changes"] == [{"step": 0, "change": "--lr 0.5 (was 0.005)"}]
    assert "resuming with --lr 0.5 (was 0.005)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, change",
    [
        (["--scan"], "--scan: not given in the run folder, given now"),
        (["--scan", "--override"], "--scan: not given in the run folder, given now"),
        (["--experts", "4", "--override"], "--experts: 0 in the run folder, 4 now"),
    ],
)
def test_the_model_shape_never_changes_on_resume(tmp_path, capsys, no_jax, argv, change):
    saved_run(tmp_path, tiny=True)
    err = refused([*argv, "--run-dir", str(tmp_path)], capsys)
    assert change in err
    assert "fix the shape of the checkpoints" in err


def test_an_old_run_folder_keeps_its_model(tmp_path, trained_with):
    # Written before the settings were kept: the model's shape and --scan only.
    shape = {"width": 32, "depth": 2, "heads": 2, "context": 32, "scan": False}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    train_lm.main(["--steps", "10", "--run-dir", str(tmp_path)])
    assert trained_with[0].tiny and not trained_with[0].scan


def test_a_finished_run_folder_says_so_at_once(tmp_path, capsys, no_jax):
    saved_run(tmp_path, tiny=True, steps=12)
    (tmp_path / "checkpoints" / "step_000012").mkdir(parents=True)
    train_lm.main(["--run-dir", str(tmp_path)])
    assert "is finished: trained to step 12 of --steps 12" in capsys.readouterr().out
    assert no_jax == []  # returned before starting JAX, let alone compiling


# ---------------------------------------------------------------------- small parts


def test_the_default_sample_prompt_is_the_documented_one():
    documented = __import__("re").search(
        r"`--sample`, default `([^`]*)`", (DOCS / "getting-started.md").read_text()
    )
    assert documented, "docs/getting-started.md no longer states --sample's default"
    assert train_lm.build_parser().parse_args([]).sample == documented.group(1)


def _updates(optimizer, params):
    """A compiled function: the updates `optimizer` makes from each gradient in turn."""

    @jax.jit
    def run(grads_seq):
        state, out = optimizer.init(params), []
        for grads in grads_seq:
            updates, state = optimizer.update(grads, state, params)
            out.append(updates)
        return out

    return run


def test_clip_limits_the_global_norm_before_adamw():
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    big = {"w": jnp.full((3, 2), 4.0), "b": jnp.array([3.0, -2.0])}  # norm > 1
    small = {"w": jnp.full((3, 2), 0.1), "b": jnp.array([0.05, 0.2])}  # norm < 1
    clipped = _updates(
        train_lm.make_optimizer(train_lm.Settings(steps=10, warmup=0, clip=1.0)), params
    )([big, small])
    plain = _updates(
        train_lm.make_optimizer(train_lm.Settings(steps=10, warmup=0, clip=0.0)), params
    )
    scale = 1.0 / float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(big))))
    by_hand = plain([jax.tree.map(lambda g: g * scale, big), small])
    unclipped = plain([big, small])
    # Adam's moments remember the clipped first gradient: the second update shows it.
    for a, b in zip(jax.tree.leaves(clipped[1]), jax.tree.leaves(by_hand[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not np.allclose(clipped[1]["w"], unclipped[1]["w"], rtol=1e-3)
    # The same optimizer state either way: a checkpoint restores whatever --clip was.
    states = [train_lm.make_optimizer(train_lm.Settings(clip=c)).init(params) for c in (0, 1)]
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])


# ---------------------------------------------------------------------- TensorBoard


def test_tensorboard_without_a_writer_is_refused(tmp_path, capsys, no_jax, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    err = refused(["--tensorboard", "--run-dir", str(tmp_path)], capsys)
    assert "--tensorboard needs a TensorBoard writer: pip install tensorboardX" in err


class FakeWriter:
    """Stands in for `tensorboardX.SummaryWriter`, recording what it is given."""

    def __init__(self, logdir):
        self.logdir, self.scalars, self.closed = logdir, [], False

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tensorboard_scalars_follow_the_metrics_log(tmp_path, monkeypatch):
    fake = types.SimpleNamespace(SummaryWriter=FakeWriter)
    monkeypatch.setitem(sys.modules, "tensorboardX", fake)
    assert train_lm.summary_writer_class() is FakeWriter
    run = train_lm.RunDir(tmp_path)
    run.write_tensorboard(train_lm.summary_writer_class())
    run.log({"step": 10, "loss": 2.5, "grad_norm": 0.75, "peak_memory_source": "compiled step"})
    run.log({"step": 10, "val": 2.25})
    run.close()
    assert run.scalars.logdir == str(tmp_path / "tensorboard") and run.scalars.closed
    assert run.scalars.scalars == [
        ("train_lm/loss", 2.5, 10),
        ("train_lm/grad_norm", 0.75, 10),
        ("train_lm/val", 2.25, 10),
    ]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_tensorboard_writes_event_files(tmp_path):
    writer_class = train_lm.summary_writer_class()
    if writer_class is None:
        pytest.skip("neither tensorboardX nor tensorboard is installed")
    run = train_lm.RunDir(tmp_path)
    run.write_tensorboard(writer_class)
    run.log({"step": 1, "loss": 5.5})
    run.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


# ------------------------------------------------- read-only, lock, signal handlers


def _deny_writes_under(monkeypatch, top: Path) -> None:
    """`os.access` says no write under `top`, as on a read-only mount (root included)."""
    real = train_lm.os.access

    def access(path, mode, *args, **kwargs):
        if mode & train_lm.os.W_OK and Path(path).absolute().is_relative_to(top):
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(train_lm.os, "access", access)


def test_a_read_only_run_folder_is_a_flag_error(tmp_path, capsys, no_jax, monkeypatch):
    run = saved_run(tmp_path / "run", tiny=True, steps=20)
    before = (tmp_path / "run" / "config.json").read_text()
    _deny_writes_under(monkeypatch, tmp_path / "run")
    err = refused(["--run-dir", str(run.path)], capsys)
    assert f"error: --run-dir {run.path}: {run.path} is read-only (or not yours)" in err
    assert f"cp -r {run.path} NEW_DIR" in err and "Traceback" not in err
    assert no_jax == [] and (tmp_path / "run" / "config.json").read_text() == before
    assert not (tmp_path / "run" / "lock").exists()


def test_a_run_folder_in_a_read_only_folder_is_a_flag_error(tmp_path, capsys, no_jax, monkeypatch):
    _deny_writes_under(monkeypatch, tmp_path / "ro")
    (tmp_path / "ro").mkdir()
    err = refused(["--run-dir", str(tmp_path / "ro" / "new" / "run")], capsys)
    assert f"cannot create it: {tmp_path / 'ro'} is read-only" in err
    assert no_jax == [] and not (tmp_path / "ro" / "new").exists()


def test_a_chmod_read_only_run_folder_is_refused(tmp_path, capsys, no_jax):
    if train_lm.os.geteuid() == 0:
        pytest.skip("root writes through chmod 555; the mocked tests above cover the message")
    run = saved_run(tmp_path / "run", tiny=True, steps=20)
    run.path.chmod(0o555)
    try:
        err = refused(["--run-dir", str(run.path)], capsys)
    finally:
        run.path.chmod(0o755)
    assert f"{run.path} is read-only (or not yours)" in err


def test_a_held_run_folder_is_refused_naming_the_holder(tmp_path, capsys, no_jax):
    run = saved_run(tmp_path, tiny=True, steps=20)
    with run.hold(), pytest.raises(SystemExit) as exit_:
        train_lm.main(["--run-dir", str(tmp_path)])
    assert exit_.value.code == 2 and no_jax == []
    err = capsys.readouterr().err.strip()
    prog = train_lm.build_parser().prog  # train_lm.py when run as a script
    assert err.startswith(
        f"{prog}: error: --run-dir {tmp_path} is in use by pid {train_lm.os.getpid()} on host "
    )
    assert ", started 20" in err and "kill -TERM" in err and len(err.splitlines()) == 1
    # Released at the end of the block: the next run takes the folder.
    with pytest.raises(Started):
        train_lm.main(["--run-dir", str(tmp_path)])
    assert no_jax == [8]


@pytest.fixture
def python_signal_handlers():
    """SIGINT and SIGTERM as a Python process starts with them, whatever this one inherited.

    A suite started in the background by a shell without job control (`cmd &`) inherits
    SIGINT ignored, and StopSignals leaves ignored signals ignored (by design), so these
    tests set the usual handlers first and put the inherited ones back after.
    """
    usual = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    inherited = {s: signal.signal(s, h) for s, h in usual.items()}
    yield
    for s, h in inherited.items():
        signal.signal(s, h)


def test_a_signal_the_process_ignores_stays_ignored(python_signal_handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with train_lm.StopSignals() as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.usefixtures("python_signal_handlers")
def test_main_restores_the_signal_handlers_however_it_ends(tmp_path, monkeypatch):
    before = {s: train_lm.signal.getsignal(s) for s in train_lm.StopSignals.SIGNALS}
    during = []

    def train(console, run, settings, args, started, stop, resume_with):
        during.append({s: train_lm.signal.getsignal(s) for s in before})
        raise SystemExit(143)

    monkeypatch.setattr(train_lm, "start_devices", lambda parser, count: None)
    monkeypatch.setattr(train_lm, "train", train)
    argv = ["--tiny", "--steps", "5", "--run-dir", str(tmp_path)]
    for _ in range(2):  # the lock is released too: the second call is not refused
        with pytest.raises(SystemExit):
            train_lm.main(argv)
    assert all(h != before[s] for s, h in during[0].items())
    assert len(during) == 2
    assert {s: train_lm.signal.getsignal(s) for s in before} == before


@pytest.mark.usefixtures("python_signal_handlers")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_only_asks_the_loop_to_stop(signum):
    previous = train_lm.signal.getsignal(signum)
    with train_lm.StopSignals() as stop:
        train_lm.os.kill(train_lm.os.getpid(), signum)  # handled before kill returns
        assert stop.received == signum  # no exception: nothing a JAX callback could swallow
        # The next one is the system's: it ends the process even inside XLA.
        assert all(
            train_lm.signal.getsignal(s) == train_lm.signal.SIG_DFL
            for s in train_lm.StopSignals.SIGNALS
        )
    assert stop.name == signum.name and stop.exit_status == 128 + signum
    assert train_lm.signal.getsignal(signum) == previous


def test_the_resume_command_names_the_run_folder(tmp_path):
    argv = ["--tiny", "--steps", "40", "--sample", "", "--run-dir", "old", "--lr=0.01"]
    command = train_lm.shlex.split(train_lm.resume_command(argv, tmp_path / "a b"))
    assert command[0] == sys.executable and Path(command[1]) == EXAMPLES / "train_lm.py"
    assert command[2:] == [
        "--tiny",
        "--steps",
        "40",
        "--sample",
        "",
        "--lr=0.01",
        "--run-dir",
        str(tmp_path / "a b"),
    ]
    for given in (["--run-dir=old"], ["--run", "old"]):
        assert train_lm.shlex.split(train_lm.resume_command(given, tmp_path))[2:] == [
            "--run-dir",
            str(tmp_path),
        ]
