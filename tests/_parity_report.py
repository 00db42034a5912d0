"""The parity suite's launcher and report: PyTorch's own FSDP2 tests on FSDP2 and torch_frontend.

    .venv/bin/python tests/_parity_report.py            # the whole port, a Markdown table
    .venv/bin/python tests/_parity_report.py --ci       # the CI subset only
    .venv/bin/python tests/_parity_report.py --cases unused_forward_output,clip_grad_norm_1d

Runs the cases of `tests/_parity_cases.py` in torchrun jobs on 127.0.0.1 (one job of 2
processes, one of 4 for the HSDP cases; each rank runs every case with FSDP2, then with
torch_frontend) and prints one row per case: `case | upstream test | FSDP2 |
torch_frontend | note`, where a failure shows its first message. The exit status is 1 if
any case failed on either implementation or did not run. `tests/test_torch_parity.py`
runs the same jobs under pytest (`FUNSHARD_PARITY=all` for the whole port).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _parity_cases as pc
from _launch import Job, port_pairs

WORKER = Path(__file__).with_name("_parity_worker.py")
IMPLS = ("fsdp2", "frontend")
# Seconds a job may take: start-up plus a generous multiple of each case's measured time.
START_S = 90
PER_CASE_S = {2: 60, 4: 240}


def selected(ci_only: bool, names: list[str] | None = None) -> list[pc.Case]:
    if names:
        return [pc.CASES[n] for n in names]
    return [c for c in pc.CASES.values() if c.ci or not ci_only]


class Jobs:
    """One torchrun job per world size, all started at once; `results()` waits for them."""

    def __init__(self, cases: list[pc.Case], root: Path, timeout_s: float | None = None):
        self.by_world: dict[int, list[pc.Case]] = {}
        for case in cases:
            self.by_world.setdefault(case.world, []).append(case)
        self.jobs: dict[int, Job] = {}
        ports = port_pairs(len(self.by_world))
        for port, (world, members) in zip(ports, sorted(self.by_world.items()), strict=True):
            out = root / f"world{world}"
            out.mkdir(parents=True, exist_ok=True)
            limit = timeout_s or START_S + PER_CASE_S[world] * len(members)
            self.jobs[world] = Job(
                WORKER, out, world, port, limit, "--cases", ",".join(c.name for c in members)
            )
        self._results: dict[tuple[str, str], dict] | None = None
        self.problems: dict[int, str] = {}

    def kill(self) -> None:
        for job in self.jobs.values():
            job.kill()

    def _wait(self, world: int, job: Job) -> None:
        if job.wait() != 0:
            took = time.monotonic() - job.start
            self.problems[world] = (
                f"the {world}-process job failed (exit {job.code}) after "
                f"{took:.0f} s:\n{job.log()[-4000:]}"
            )

    def results(self) -> dict[tuple[str, str], dict]:
        """{(case, impl): result} of every case that finished; waits for every job."""
        if self._results is None:
            found = {}
            for world, job in self.jobs.items():
                self._wait(world, job)
                path = job.out / "results.json"
                for result in json.loads(path.read_text()) if path.exists() else []:
                    found[(result["case"], result["impl"])] = result
            self._results = found
        return self._results

    def missing(self, case: pc.Case) -> str:
        return f"{case.name} did not run: " + self.problems.get(
            case.world, "its job ended before it"
        )

    @property
    def seconds(self) -> float:
        return max(time.monotonic() - j.start for j in self.jobs.values())


def _cell(result: dict | None, chars: int = 160) -> str:
    if result is None:
        return "not run"
    run, failed = result["subtests"]
    if result["ok"]:
        return f"pass ({run} subtest{'s' * (run != 1)})" if run else "pass"
    grid = (
        f" ({failed} of {run} subtests)"
        if run
        else f" ({result['failures']} failed checks)"
        if result.get("failures", 0) > 1
        else ""
    )
    first = result["messages"][0] if result["messages"] else "failed"
    first = first.replace("|", "/").replace("\n", " ")
    return f"**FAIL**{grid}: {first if len(first) <= chars else first[: chars - 3] + '...'}"


def table(cases: list[pc.Case], results: dict) -> str:
    rows = ["| case | upstream test | FSDP2 | torch_frontend | note |", "|---|---|---|---|---|"]
    for case in cases:
        file, _, test = case.upstream.partition("::")
        upstream = f"`{file.removeprefix('test_fully_shard_').removesuffix('.py')}::{test}`"
        cells = [_cell(results.get((case.name, impl))) for impl in IMPLS]
        note = case.note
        if case.world == 4 and "world" not in note:
            note = "; ".join(filter(None, ("world 4", note)))
        for impl in case.xfail:
            name = "torch_frontend" if impl == "frontend" else "FSDP2"
            note = "; ".join(filter(None, (note, f"measured failure on {name} (strict xfail)")))
        name = f"`{case.name}`" + (" (CI)" if case.ci else "")
        rows.append(f"| {name} | {upstream} | {cells[0]} | {cells[1]} | {note} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ci", action="store_true", help="the CI subset only")
    ap.add_argument("--cases", default="", help="comma-separated case names")
    ap.add_argument("--keep", default="", help="directory for the jobs' logs and results")
    ap.add_argument("--table-of", default="", help="only print the table of an earlier --keep")
    args = ap.parse_args()
    cases = selected(args.ci, [n for n in args.cases.split(",") if n])
    if args.table_of:
        results = {
            (r["case"], r["impl"]): r
            for path in Path(args.table_of).glob("*/results.json")
            for r in json.loads(path.read_text())
        }
        print(table([c for c in cases if any((c.name, i) in results for i in IMPLS)], results))
        return 0
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="parity-"))
    jobs = Jobs(cases, root)
    try:
        results = jobs.results()
    finally:
        jobs.kill()
    print(table(cases, results))
    passed = {
        impl: sum(bool(results.get((c.name, impl), {}).get("ok")) for c in cases) for impl in IMPLS
    }
    print(
        f"\n{len(cases)} cases in {jobs.seconds:.0f} s: FSDP2 passed {passed['fsdp2']}, "
        f"torch_frontend passed {passed['frontend']} (logs: {root})"
    )
    for problem in jobs.problems.values():
        print(f"\n{problem}", file=sys.stderr)
    return 0 if all(n == len(cases) for n in passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
