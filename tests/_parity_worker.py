"""One torchrun job of the parity suite: PyTorch's own FSDP2 tests, on FSDP2 and torch_frontend.

    torchrun --nproc-per-node 2 tests/_parity_worker.py --out DIR --deadline S --cases a,b,...

Every rank runs each case of `tests/_parity_cases.py` twice, first with FSDP2's
`fully_shard` (the control), then with torch_frontend's, both on torch's default gloo
group (opened here with a bounded timeout, then adopted by `init_distributed()`, which
also starts JAX's runtime). A case's exception or failed assertions are caught and
recorded, so one failure does not stop the rest. After each (case, implementation) the
ranks exchange their outcomes; rank 0 rewrites `results.json` (a list of
`{case, impl, ok, seconds, subtests, messages}`) and every rank rewrites
`rank{r}.json` with its own, so a job that dies part way still leaves what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

GLOO_TIMEOUT_S = 120  # a rank left waiting in a torch collective fails instead of hanging


def _write_json(path: Path, data) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(data, indent=1))
    os.replace(part, path)


def run_one(case, impl, rank: int, world: int) -> dict:
    import _parity_cases as pc

    t = pc.T(rank, world)
    start = time.monotonic()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    try:
        case.fn(t, impl)
    except Exception as error:
        t.record(pc._describe(error))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        gc.collect()
    return {
        "ok": t.failures == 0,
        "failures": t.failures,
        "messages": t.messages,
        "subtests": [t.subtests_run, t.subtests_failed],
        "seconds": round(time.monotonic() - start, 2),
    }


def merge(case, impl_name: str, outcomes: list[dict]) -> dict:
    """One result from every rank's outcome: it passed if it passed on every rank."""
    per_rank = [o["messages"] for o in outcomes]
    if all(m == per_rank[0] for m in per_rank):
        messages = per_rank[0]  # the same on every rank
    else:
        messages = [f"rank {r}: {m}" for r, ms in enumerate(per_rank) for m in ms]
    return {
        "case": case.name,
        "upstream": case.upstream,
        "impl": impl_name,
        "ok": all(o["ok"] for o in outcomes),
        "messages": messages[:4],
        "failures": max(o["failures"] for o in outcomes),
        "subtests": max((o["subtests"] for o in outcomes), key=lambda s: s[1]),
        "seconds": max(o["seconds"] for o in outcomes),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=600.0)
    ap.add_argument("--cases", required=True, help="comma-separated case names")
    ap.add_argument("--impls", default="fsdp2,frontend")
    args = ap.parse_args()
    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))  # the test kills workers by pid
    watchdog = threading.Timer(args.deadline, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    warnings.simplefilter("ignore")  # upstream's tests check no warnings; keep the log short

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    import torch_frontend

    torch_frontend.init_distributed()  # JAX's runtime; adopts the group above
    import _parity_cases as pc
    from _launch import settle_gc

    settle_gc()
    world = dist.get_world_size()
    impls = pc.make_impls()
    chosen = [impls[name] for name in args.impls.split(",")]
    results, mine = [], []
    for name in args.cases.split(","):
        case = pc.CASES[name]
        for impl in chosen:
            outcome = run_one(case, impl, rank, world)
            mine.append({"case": name, "impl": impl.name, **outcome})
            _write_json(out / f"rank{rank}.json", mine)
            outcomes: list = [None] * world
            dist.all_gather_object(outcomes, outcome)
            results.append(merge(case, impl.name, outcomes))
            if rank == 0:
                _write_json(out / "results.json", results)
                status = "ok" if results[-1]["ok"] else "FAIL"
                print(f"{name} [{impl.name}] {status} {outcome['seconds']:.1f}s", flush=True)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13's gloo teardown can abort at interpreter exit


if __name__ == "__main__":
    sys.exit(main())
