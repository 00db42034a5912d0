"""FSDP benchmark: funshard against JAX's own data-parallel forms, side by side, in ONE run.

Run from the repository root (8 simulated CPU devices):

    python benchmarks/bench_fsdp.py                 # default GPT-style model (~15 min, 2 cores)
    python benchmarks/bench_fsdp.py --quick         # tiny model, smoke run (~1 min)
    python benchmarks/bench_fsdp.py --out bench.md  # also write the Markdown report

Every number printed is measured in this run: collectives are read from each variant's
compiled HLO (`jax.jit(step).lower(...).compile().as_text()`, parsed by `hlo.py`, the
parser the tests share), memory from `compiled.memory_analysis()`, FLOPs from
`compiled.cost_analysis()`, per-device state from the arrays' `addressable_shards`, step
times with `jax.block_until_ready`. All programs are compiled first; then the variants'
steps run interleaved (round r runs step r of every variant), so that other load on the
machine hits all variants alike. Besides the variants, the run compiles (never executes)
plain `jax.grad` of one device's batch slice on one device (its temp bytes are the
activation term of the memory target), variant 1 with twice the batch (temp-byte growth
with the batch, for comparison) and variant 1 on 1, 2 and 4 devices (scaling table).
Last, it compiles `fs.value_and_grad(loss, microbatches=k)` of variant 1's loss for
k = 1, 2, 8 (three times each, `sync_every_microbatch` True and False) and reports
compile time and HLO size against k (`fsdp/microbatches.py`; `--no-microbatches`
skips it).

Every step is loss + gradients + an `optax.adamw` update of the model in `fsdp/model.py`
(a GPT-style decoder), returning the new parameters and optimizer state. The variants,
one module each in `fsdp/variants/` (a new one is one file there; see its
`__init__.py`):

1. funshard, one `fs.fully_shard` unit per block, `reshard_after_forward=True`.
2. the same with `reshard_after_forward=False`.
3. funshard with the blocks stacked and run by `fs.scan`.
4. JAX automatic sharding ("FSDP by annotation"): plain `jax.jit`, parameters and Adam
   state `P('fsdp')` on dim 0 where 8 divides it (else replicated), batch `P('fsdp')`.
5. replicated data parallel: `jax.shard_map`, parameters replicated, gradients `pmean`.
6. single device: plain `jax.jit` on `jax.devices()[0]`, the whole batch.
7. communication-free floor: ONE device runs what one FSDP device computes, with every
   collective removed (see `fsdp/variants/floor.py`).
8. collectives only: the all-gathers / reduce-scatters of variant 1 and nothing else
   (see `fsdp/variants/collectives_only.py`).
"""

from fsdp.cli import main  # configures 8 simulated CPU devices before JAX starts

if __name__ == "__main__":
    main()
