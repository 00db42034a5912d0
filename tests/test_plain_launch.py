"""torch_frontend launched as FSDP2 users launch without torchrun: variables set by hand.

Two `python tests/_torch_worker.py` processes on 127.0.0.1 with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT and nothing else. Before the port rule (JAX's coordinator on
MASTER_PORT + 1 whatever the launcher), JAX's coordinator took MASTER_PORT, torch's
TCPStore then failed with EADDRINUSE on rank 0, and rank 1 was aborted (SIGABRT): 2 of
2 runs. Each job trains the "seq" case with torch_frontend, then with PyTorch's FSDP2
on the same default process group; the numbers must agree, whichever runtime opened
first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")
from _launch import free_port, launch, rank_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]

WORKER = Path(__file__).with_name("_torch_worker.py")
TIMEOUT_S = 150
TOLERANCE = 1e-5  # as tests/test_torch_frontend.py


def _load(out: Path, impl: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(out / f"seq-{impl}-rank{rank}.npz") as data:
        return {k: v for k, v in data.items() if k.startswith(("loss", "grad/", "param/"))}


@pytest.mark.parametrize("group_first", [False, True], ids=["jax-first", "torch-group-first"])
def test_frontend_without_torchrun_matches_fsdp2(tmp_path, group_first):
    port = free_port(pair=True)  # MASTER_PORT: torch's store; MASTER_PORT + 1: JAX's
    argv = [sys.executable, str(WORKER), "--out", str(tmp_path), "--cases", "seq"]
    argv += ["--deadline", str(TIMEOUT_S), *(["--group-first"] if group_first else [])]
    with launch(tmp_path, {r: (argv, rank_env(r, 2, port)) for r in range(2)}, TIMEOUT_S) as job:
        codes = job.wait()
        logs = job.logs()
    assert codes == {0: 0, 1: 0}, "\n".join(f"rank {r}: {t[-3000:]}" for r, t in logs.items())
    for rank in range(2):
        ours, theirs = _load(tmp_path, "frontend", rank), _load(tmp_path, "fsdp2", rank)
        assert sorted(ours) == sorted(theirs) and "loss" in ours
        for name, want in theirs.items():
            assert ours[name].shape == want.shape, (rank, name)
            np.testing.assert_allclose(
                ours[name], want, rtol=0, atol=TOLERANCE, err_msg=f"rank {rank}: {name}"
            )
