"""PyTorch's own FSDP2 tests, ported (`tests/_parity_cases.py`), on FSDP2 and on torch_frontend.

One test per case and implementation: the FSDP2 test shows the port is right (the control),
the torch_frontend test shows parity. By default this runs the CI subset (the cases with
`ci=True`) in one 2-process torchrun job; the whole port (more jobs, HSDP on 4 processes)
runs with

    FUNSHARD_PARITY=all .venv/bin/python -m pytest tests/test_torch_parity.py

or, printing the result table of docs/torch.md, `.venv/bin/python tests/_parity_report.py`;
`FUNSHARD_PARITY=case1,case2` runs just those cases.
A measured failure of a case is `xfail(strict=True)` with its reason (`Case.xfail`): it
must keep failing, and it shows as a failure in the table.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")
import _parity_cases as pc  # imports torch
from _parity_report import IMPLS, Jobs, selected

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess, pytest.mark.slow]

CHOSEN = os.environ.get("FUNSHARD_PARITY", "")
CASES = selected(
    ci_only=CHOSEN != "all", names=[n for n in CHOSEN.split(",") if n] if CHOSEN != "all" else None
)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    started = Jobs(CASES, tmp_path_factory.mktemp("parity"))
    yield started
    started.kill()


def _params():
    for case in CASES:
        for impl in IMPLS:
            marks = ()
            if impl in case.xfail:
                marks = pytest.mark.xfail(strict=True, reason=case.xfail[impl])
            yield pytest.param(case.name, impl, id=f"{case.name}-{impl}", marks=marks)


@pytest.mark.parametrize(("name", "impl"), list(_params()))
def test_upstream_case(jobs, name, impl):
    case = pc.CASES[name]
    result = jobs.results().get((name, impl))
    assert result is not None, jobs.missing(case)
    run, failed = result["subtests"]
    grid = f" ({failed} of {run} subtests failed)" if run else ""
    assert result["ok"], f"{case.upstream} failed on {impl}{grid}:\n" + "\n".join(
        result["messages"]
    )


def test_the_ci_subset_covers_every_area():
    areas = {c.upstream.split("::")[0] for c in pc.CASES.values() if c.ci}
    for area in (
        "training",
        "autograd",
        "frozen",
        "mixed_precision",
        "clip_grad_norm_",
        "state_dict",
        "comm",
        "init",
    ):
        assert f"test_fully_shard_{area}.py" in areas, area
    # FSDP2 composed with tensor parallelism (2-D meshes)
    assert "test_2d_composability.py" in areas
