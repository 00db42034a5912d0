"""docs/parallelism.md's worked examples run as printed, on the test session's 8 devices.

Each example ends with its own check against the same model on one device (loss, every
gradient and, for the Megatron GPT, the AdamW update), so running it is the test; the
Megatron example also runs with its mesh line changed to HSDP, which the page says works.
"""

import pytest
from _docs import python_block

PAGE = "parallelism.md"
MEGATRON, MOE = "Worked example: a Megatron GPT", "Worked example: a mixture of experts"


def example(heading: str) -> str:
    """The first Python block under the `## ` heading that starts with `heading`."""
    return python_block(PAGE, heading)


@pytest.mark.slow
@pytest.mark.parametrize("heading", [MEGATRON, MOE])
def test_worked_example_matches_one_device(heading):
    exec(compile(example(heading), f"{PAGE}: {heading}", "exec"), {})


@pytest.mark.slow
def test_megatron_example_on_hsdp():
    code = example(MEGATRON)
    fsdp_tensor = 'mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))'
    hsdp = 'mesh = jax.make_mesh((2, 2, 2), ("replicate", "fsdp", "tensor"))'
    sharded = "state = fs.shard(params, mesh, model_spec=MODEL_SPEC)"
    assert fsdp_tensor in code and sharded in code
    code = code.replace(fsdp_tensor, hsdp).replace(
        sharded, 'state = fs.shard(params, mesh, replicate_axis="replicate", model_spec=MODEL_SPEC)'
    )
    exec(compile(code, f"{PAGE}: {MEGATRON} (HSDP)", "exec"), {})
