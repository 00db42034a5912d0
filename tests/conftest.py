"""Test setup: 8 simulated CPU devices, requested before JAX initialises its backend."""

import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite compiles thousands of small programs on the CPU, and XLA's CPU backend spends
# much of each compile in LLVM's optimisation passes. With fewer of them, tests/test_hlo.py
# runs in 25.6 s instead of 33.9 s, and the whole suite in 1153 s instead of 1316 s
# (2 workers, 2 cores). Only the machine code is less optimised: the HLO, its collectives
# and its buffer assignment (what the tests read) are the default's, and every test
# compares programs compiled alike. Level 1, not 0: at level 0 a bf16 subnormal padded
# by a compiled program came back as 0, and L-BFGS's rounding drifted past its
# tolerance. The processes the tests start inherit the flags. A flag the caller set in
# XLA_FLAGS is kept as it is.
# Not `--xla_cpu_use_fusion_emitters=false` (jaxlib 0.10 only): it compiles 8 small FSDP
# train steps in 4.0 s of CPU instead of 7.1 s, but its emitters quiet the payload of a
# bfloat16 NaN that `fs.shard` pads (tests/test_properties.py), where the default keeps
# the bits.
FAST_COMPILE = ("--xla_backend_optimization_level=1", "--xla_llvm_disable_expensive_passes=true")
if os.environ["JAX_PLATFORMS"] == "cpu":
    _given = os.environ.get("XLA_FLAGS", "")
    _added = [f for f in FAST_COMPILE if f.split("=")[0] not in _given]
    os.environ["XLA_FLAGS"] = " ".join([_given, *_added]).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hypothesis

import funshard as fs

hypothesis.settings.register_profile(
    "funshard",
    deadline=None,
    max_examples=25,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "funshard"))

# (name, replicate): the meshes every sweep runs on.
MESHES = {"1": (1, None), "2": (2, None), "4": (4, None), "8": (8, None), "2x4": (8, 2)}


def mesh_for(name: str):
    """The mesh called `name` in MESHES, on the first devices."""
    count, replicate = MESHES[name]
    return fs.make_mesh(replicate, devices=jax.devices()[:count])


# The processes the tests start (tests/_launch.py's `clean_env`) share one persistent
# compilation cache per test session: most of them are examples and jobs that compile the
# same programs as an earlier one (a run and its resume, the ranks of a job), and a
# `train_lm.py --tiny` run spends more time compiling its ~120 programs (model init,
# checkpoint slices, the step) than training. The test processes themselves do not use it.
CACHE_VAR = "FUNSHARD_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller made the folder
        return
    if CACHE_VAR not in os.environ:
        os.environ[CACHE_VAR] = tempfile.mkdtemp(prefix="funshard-tests-jax-cache-")
        config.funshard_cache_dir = os.environ[CACHE_VAR]


def pytest_unconfigure(config):
    made = getattr(config, "funshard_cache_dir", None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[CACHE_VAR]


def pytest_collection_finish(session):
    # Every test module, and with them torch, flax and optax, is imported by now: their
    # objects live as long as the process, and the collector's full passes need not walk
    # them again. tests/test_randomness.py alone: 43.5 s of CPU instead of 47.5 s (see
    # also tests/_launch.py's `settle_gc`). Garbage is collected as often as before, so
    # no finaliser's warning moves to another test.
    gc.freeze()
