"""The FSDP benchmark as a package; `benchmarks/bench_fsdp.py` is its entry point.

Modules, one concern each:

* `model`: the GPT-style model (config, parameters, loss) and its FSDP unit sizes.
* `variants/`: one small module per way of training that model (funshard, JAX's own
  data-parallel forms, yardsticks); each registers its builders with
  `variants.register`. See `variants/__init__.py` for how to add one.
* `probes`: programs only compiled and read, never run (activation probe, scaling).
* `microbatches`: compile time and HLO size of `microbatches=k` against k.
* `measure`: compiling, reading facts out of the compiled programs, timing the steps.
* `report`, `targets`: the Markdown report and its PASS/MISS checks.
* `cli`: flags and the order of a run.

Collectives are read from the compiled HLO by `benchmarks/hlo.py`, the parser the tests
share.

Importing this package configures JAX for 8 simulated CPU devices, which must happen
before JAX starts a backend, so it comes before every other import of the benchmark.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

NUM_DEVICES = 8
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
