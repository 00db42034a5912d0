"""examples/train_torch.py under torchrun (2 processes) and benchmarks/bench_torch.py --quick.

The example runs as a user runs it: `torchrun --nproc-per-node 2 examples/train_torch.py`
on 127.0.0.1, a few steps of the tiny model, checkpointing; then again with `--resume`
from an earlier checkpoint, which must redo the later steps with the very same losses.
The benchmark's smoke run keeps it from rotting. Every job has a timeout, and every
process it started (torchrun, its workers) is killed on the way out.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest
from _launch import ROOT, free_port, run_bounded, torchrun_command

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLE = ROOT / "examples" / "train_torch.py"
BENCH = ROOT / "benchmarks" / "bench_torch.py"
JOB_TIMEOUT_S = 120
TINY = ["--tiny", "--batch", "8", "--log-every", "3", "--checkpoint-every", "3"]


def torchrun(script: Path, *args: str, cwd: Path, processes: int = 2) -> str:
    command = torchrun_command(script, processes, free_port(pair=True), *args)
    start = time.monotonic()
    code, out = run_bounded(command, cwd, JOB_TIMEOUT_S)
    assert code == 0, (
        f"{script.name} {args} failed (exit {code}) after "
        f"{time.monotonic() - start:.0f} s:\n{out[-6000:]}"
    )
    return out


def metrics(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def test_train_torch_on_two_processes_checkpoints_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    first = torchrun(EXAMPLE, *TINY, "--steps", "6", "--run-dir", str(run_dir), cwd=tmp_path)
    assert "2 rank(s)" in first
    progress = [line for line in first.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["3", "6"], first
    assert all("tokens/s" in line for line in progress)
    losses = metrics(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(x) for x in losses.values())
    assert losses[1] > 5.0 and losses[6] < losses[1]  # ln 256 = 5.55 at the start, then learns
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000003", "step_000006"]

    # As if the run had died after step 3's checkpoint: the resumed run redoes 4..6.
    shutil.rmtree(checkpoints / "step_000006")
    second = torchrun(
        EXAMPLE, *TINY, "--steps", "6", "--run-dir", str(run_dir), "--resume", cwd=tmp_path
    )
    assert "resumed at step 3" in second, second
    resumed = metrics(run_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):  # same batches, same state: the same losses
        assert math.isclose(resumed[step], losses[step], rel_tol=1e-6, abs_tol=1e-6), (
            step,
            resumed[step],
            losses[step],
        )
    assert (checkpoints / "step_000006").is_dir()


@pytest.fixture(scope="module")
def bench_quick(tmp_path_factory):
    """One `bench_torch.py --quick --rss` run: every variant interleaved, then the frontend
    and FSDP2 each alone for resident memory (three torchrun jobs). (result.json's facts,
    the folder of result.md.)"""
    tmp_path = tmp_path_factory.mktemp("bench_torch")
    result = tmp_path / "result.json"
    code, out = run_bounded(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--profile-steps",
            "1",
            "--rss",
            "--out-json",
            str(result),
            "--out-md",
            str(tmp_path / "result.md"),
        ],
        tmp_path,
        3 * JOB_TIMEOUT_S,  # three torchrun jobs: the interleaved one, then one each alone
    )
    assert code == 0, out[-6000:]
    return json.loads(result.read_text()), tmp_path


def test_bench_torch_quick_runs_every_variant(bench_quick):
    facts, tmp_path = bench_quick
    rows = {v["name"]: v for v in facts["variants"]}
    assert set(rows) == {
        "torch_frontend reshard=True",
        "FSDP2 reshard=True",
        "torch_frontend reshard=False",
        "FSDP2 reshard=False",
        "DDP",
        "funshard JAX step reshard=True",
        "1 process alone",
        "compute floor (1 rank's rows)",
    }
    for row in rows.values():
        assert len(row["times"]) == 2 and row["median"] > 0, row["name"]
        assert all(math.isfinite(x) for x in row["losses"]), row["name"]
        assert row["state"] > 0, row["name"]
    for name in (
        "torch_frontend reshard=True",
        "FSDP2 reshard=True",
        "DDP",
        "funshard JAX step reshard=True",
    ):
        assert rows[name]["sent"] > 0, name  # gloo wrote to its sockets
    assert rows["compute floor (1 rank's rows)"]["sent"] < 1024
    # The same model, weights and data: the frontend trains exactly as FSDP2, and the
    # JAX step and the single process see the same global losses (float rounding apart).
    assert [c["equal"] for c in facts["loss_checks"]] == [True, True]
    jax_losses = rows["funshard JAX step reshard=True"]["losses"]
    np_close = [
        math.isclose(a, b, abs_tol=1e-3)
        for a, b in zip(jax_losses, rows["1 process alone"]["losses"], strict=True)
    ]
    assert all(np_close), (jax_losses, rows["1 process alone"]["losses"])
    assert {p["variant"] for p in facts["profile"]} == {
        "torch_frontend reshard=True",
        "torch_frontend reshard=False",
    }
    assert "| torch_frontend reshard=True |" in (tmp_path / "result.md").read_text()


def test_the_benchmarks_memory_sampler_sees_an_anonymous_peak():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np
    from torch_bench import measure

    before = measure.anonymous_bytes()
    sampler = measure.ResidentSampler(period_s=0.001)
    block = np.ones(64 * 2**20, np.uint8)  # 64 MiB, every page touched
    # Wait until the sampler's thread has seen the block, however loaded the machine.
    deadline = time.monotonic() + 30
    while (
        min(sampler.peaks["RssAnon"], sampler.peaks["Anonymous"]) < before + 60 * 2**20
        and time.monotonic() < deadline
    ):
        time.sleep(0.001)
    del block
    peaks = sampler.stop()
    # The block raised the anonymous peak by its size, as /proc/self/status and
    # /proc/self/smaps_rollup both count it; the file-backed part is code.
    assert peaks["peak_anon"] >= before + 60 * 2**20, (before, peaks)
    assert peaks["peak_rollup_anon"] >= before + 60 * 2**20, (before, peaks)
    assert 0 < peaks["peak_file"] < measure.peak_resident_bytes()


def test_bench_torch_rss_separates_what_fsdp_controls_from_start_up(bench_quick):
    alone = bench_quick[0]["alone"]
    assert set(alone) == {"frontend-True", "fsdp2-True"}
    for key, (job,) in alone.items():
        # What FSDP controls is the peak above the process after imports, process group
        # and plain model (each the larger rank's); that process holds at least what the
        # imports left.
        assert 0 < job["delta"] < job["peak"] and 0 < job["delta_anon"] < job["peak_anon"], key
        assert job["base"] >= job["imports_rss"] > 0, key
        assert job["imports_rss"] >= job["imports_anon"] + job["imports_file"] - 2**20, key
        assert job["shard_anon"] > 0 and job["shard_file"] > 0, key
    # The FSDP2 job never imports JAX: jaxlib's code pages are the frontend's alone.
    assert alone["fsdp2-True"][0]["imports_file"] < alone["frontend-True"][0]["imports_file"]
