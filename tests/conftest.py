"""Test setup: 8 simulated CPU devices, requested before JAX initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
