"""Saves a small checkpoint, says so, then saves a large one until killed (atomicity test)."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp

import funshard as fs


def main(root: str, mode: str) -> None:
    mesh = fs.make_mesh()
    big = {"w": jnp.ones((4096, 8192), jnp.float32)}  # 128 MiB: the save takes a while
    target = os.path.join(root, "step_2" if mode == "new" else "step_1")
    print("saving", flush=True)
    fs.save(target, fs.shard(big, mesh), overwrite=(mode == "overwrite"))
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
