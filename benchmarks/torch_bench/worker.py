"""One rank of the benchmark's torchrun job (started by `benchmarks/bench_torch.py`).

    torchrun --nproc-per-node 2 benchmarks/torch_bench/worker.py --out DIR [--quick] ...

Starts JAX's runtime and torch's gloo process group (both by
torch_frontend.init_distributed), builds every variant, then runs rounds: round r runs
step r of every variant in turn (starting at a rotating variant), each after a barrier, so
that load on the machine hits all variants alike. After the timed rounds come one memory step per
variant and, with `--profile`, a few profiled steps of the frontend. Writes
`rank{r}.json` into DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the package

import torch

from torch_bench import measure, variants
from torch_bench import model as gpt


def parse_args(argv=None) -> tuple[argparse.Namespace, gpt.Config]:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--deadline", type=float, default=3600.0)
    p.add_argument("--only", default="", help="comma-separated variant keys (default: all)")
    p.add_argument("--compile", action="store_true", help="block.compile() every block")
    p.add_argument(
        "--sample-memory",
        action="store_true",
        help="sample the peaks of anonymous and file-backed resident memory",
    )
    p.add_argument(
        "--malloc",
        choices=("trimmed", "default"),
        default="trimmed",
        help="trimmed: glibc returns freed blocks over 64 KiB at once (default)",
    )
    for field in dataclasses.fields(gpt.Config):
        p.add_argument(f"--{field.name}", type=int, default=None)
    args = p.parse_args(argv)
    base = gpt.QUICK if args.quick else gpt.Config()
    cfg = dataclasses.replace(
        base,
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(gpt.Config)
            if getattr(args, f.name) is not None
        },
    )
    return args, cfg


TORCH_ONLY = ("fsdp2", "ddp", "single", "floor")  # variant keys that need no JAX


def log(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def build_all(
    cfg: gpt.Config,
    rank: int,
    world: int,
    mesh,
    only: str = "",
    compile_blocks: bool = False,
    mark=variants.no_mark,
) -> list[variants.Variant]:
    """Every variant `only` names; `mark` sees the first two (reshard=True) built."""
    from torch.distributed.device_mesh import init_device_mesh

    torch_mesh = init_device_mesh("cpu", (world,))
    builders = {
        "frontend-True": lambda: variants.frontend(cfg, True, compile_blocks, mark),
        "fsdp2-True": lambda: variants.fsdp2(cfg, True, torch_mesh, compile_blocks, mark),
        "frontend-False": lambda: variants.frontend(cfg, False),
        "fsdp2-False": lambda: variants.fsdp2(cfg, False, torch_mesh),
        "ddp": lambda: variants.ddp(cfg),
        "jax": lambda: variants.funshard_jax(cfg, mesh),
        "single": lambda: variants.single_process(cfg, rank, threads=os.cpu_count() or 1),
        "floor": lambda: variants.compute_floor(cfg),
    }
    keys = only.split(",") if only else list(builders)
    unknown = [k for k in keys if k not in builders]
    if unknown:
        raise SystemExit(f"--only: unknown variants {unknown}; choose from {list(builders)}")
    built = [builders[k]() for k in keys]
    log(rank, "built " + ", ".join(v.name for v in built))
    return built


def run_rounds(vs, cfg, rank, world, rounds: int, warmup: int) -> dict:
    import torch.distributed as dist

    rows = cfg.batch // world
    out = {v.name: {"times": [], "all_times": [], "losses": [], "sent": []} for v in vs}
    for r in range(rounds):
        batch = gpt.batch_at(r, cfg)
        local = torch.from_numpy(batch[rank * rows : (rank + 1) * rows])
        shift = r % len(vs)
        for v in vs[shift:] + vs[:shift]:
            dist.barrier()  # every rank starts the step together
            seconds, loss, sent = measure.timed(v.step, local, batch)
            rec = out[v.name]
            rec["losses"].append(loss)
            rec["all_times"].append(seconds)  # warm-up included: the first step compiles
            if r >= warmup:
                rec["times"].append(seconds)
                rec["sent"].append(sent)
        kind = "warm-up" if r < warmup else "timed"
        log(
            rank,
            f"round {r + 1}/{rounds} ({kind}): "
            + ", ".join(
                f"{v.name} {out[v.name]['times'][-1] * 1e3:,.0f} ms" if r >= warmup else v.name
                for v in vs
            ),
        )
    return out


def memory_pass(vs, cfg, rank, world) -> dict:
    import torch.distributed as dist

    measure.return_freed_memory()
    rows = cfg.batch // world
    batch = gpt.batch_at(10_000, cfg)
    local = torch.from_numpy(batch[rank * rows : (rank + 1) * rows])
    out = {}
    for v in vs:
        dist.barrier()
        out[v.name] = {**measure.step_memory(v.step, local, batch), "state": v.state_bytes()}
    return out


def profile_pass(vs, cfg, rank, world, steps: int) -> dict:
    import torch.distributed as dist

    profiler = measure.BridgeProfile()
    profiler.install()
    rows = cfg.batch // world
    out = {}
    for v in (v for v in vs if v.name.startswith("torch_frontend")):
        times = []
        with profiler.recording():
            for i in range(steps):
                batch = gpt.batch_at(20_000 + i, cfg)
                local = torch.from_numpy(batch[rank * rows : (rank + 1) * rows])
                dist.barrier()
                times.append(measure.timed(v.step, local, batch)[0])
        out[v.name] = {
            "steps": steps,
            "step_s": times,
            "seconds": dict(profiler.seconds),
            "calls": dict(profiler.calls),
        }
    return out


def main(argv=None) -> int:
    args, cfg = parse_args(argv)
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    watchdog = threading.Timer(args.deadline, os._exit, args=(3,))
    watchdog.daemon = True  # a rank whose peer died, blocked in a collective, ends itself
    watchdog.start()
    torch.set_num_threads(1)  # one compute thread per rank: 2 ranks on 2 cores
    # From the start, not just before the memory pass: blocks malloc'd earlier from the
    # heap and freed stay resident, and would count against whichever variant frees
    # and re-allocates its buffers in its measured step.
    if args.malloc == "trimmed":
        measure.return_freed_memory()

    import torch.distributed as dist

    # Resident memory at each phase of start-up (imports, process group, the plain model,
    # the first fully_shard), the first time it is reached.
    phases: dict[str, dict] = {}

    def mark(phase: str) -> None:
        phases.setdefault(phase, measure.resident_parts())

    sampler = measure.ResidentSampler() if args.sample_memory else None
    started = time.perf_counter()
    if args.only and all(k.split("-")[0] in TORCH_ONLY for k in args.only.split(",")):
        # torch's variants alone: a process as a plain FSDP2 script has it, no JAX.
        import torch.distributed.fsdp as _fsdp  # noqa: F401  (what an FSDP2 script imports)

        mark("imports")
        dist.init_process_group("gloo")
        mesh = None
    else:
        import torch_frontend

        mark("imports")
        mesh = torch_frontend.init_distributed()  # JAX's runtime and torch's gloo group
    mark("init")
    rss_start = measure.resident_bytes()
    world = dist.get_world_size()
    if cfg.batch % world:
        raise SystemExit(f"--batch {cfg.batch} must be a multiple of the {world} ranks")
    log(rank, f"{world} ranks; model {cfg}; {cfg.params():,} parameters")
    vs = build_all(cfg, rank, world, mesh, args.only, args.compile, mark)
    build_s = time.perf_counter() - started
    timing = run_rounds(vs, cfg, rank, world, args.warmup + args.steps, args.warmup)
    # The whole process's peak so far (start-up, build, timed steps), before the memory
    # pass resets the kernel's counter per step.
    rss_process = {
        "start": rss_start,
        "peak": measure.peak_resident_bytes(),
        "phases": phases,
        **(sampler.stop() if sampler is not None else {}),
    }
    memory = memory_pass(vs, cfg, rank, world)
    profile = profile_pass(vs, cfg, rank, world, args.profile_steps) if args.profile_steps else {}
    result = {
        "rank": rank,
        "world": world,
        "config": dataclasses.asdict(cfg),
        "steps": args.steps,
        "warmup": args.warmup,
        "build_s": build_s,
        "only": args.only,
        "rss_process": rss_process,
        "compile": args.compile,
        "variants": [
            {
                "name": v.name,
                "peer": v.peer,
                "note": v.note,
                "loss_scope": v.loss_scope,
                "facts": v.facts,
                **timing[v.name],
                "memory": memory[v.name],
            }
            for v in vs
        ],
        "profile": profile,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    log(rank, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
