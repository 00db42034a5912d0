"""Every process of a job must trace its training step on the same state layout.

A compiled step's collectives are sized by the state it was traced with. Two processes
that built different models (process 1 with 18 rows in a weight where process 0 has 16)
compile programs whose all-gathers differ in size, and gloo then aborts both processes
in the first one (measured: SIGABRT, `EnforceNotMet ... 400 vs 336`), with nothing that
names the parameter. So at trace time of `fs.value_and_grad`'s step each process
compares its state's signature (structure, shapes, dtypes, sharded layout and
mixed-precision policy of every leaf) with the others' through JAX's coordination
service, once per distinct signature per process, and every process raises the same
`DistributedError` naming the first leaf that differs.

The comparison posts a digest only (two counter increments and one read of the verdict
per distinct signature; measured in tests/test_state_agreement.py); the full signatures
travel only after a mismatch. Single-process runs never come here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import time
from typing import Any

import jax
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path

from funshard import _jax_compat, _text, errors
from funshard.comm import _departures, _key_value
from funshard.comm._layout import LayoutFacts

logger = logging.getLogger(__name__)

_ROOT = "funshard/state/"
_agreed: set[str] = set()  # digests of the signatures every process traced alike
_checks = itertools.count()  # numbers this process's distinct signatures, in order


def _is_layout(x: Any) -> bool:
    # `fs.Sharded` (funshard.core, a floor above this one) is a LayoutFacts.
    return isinstance(x, LayoutFacts)


def _leaf_signature(x: Any) -> dict:
    """What of one leaf the compiled step depends on, as JSON-ready data."""
    if _is_layout(x):
        return {
            "kind": "sharded",
            "shape": list(x.shape),
            "dtype": np.dtype(x.dtype).name,
            "dim": x.dim,
            "shard_axis": list(x.shard_axis),
            "replicate_axis": list(x.replicate_axis),
            "mp_policy": None if x.mp_policy is None else repr(x.mp_policy),
        }
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return {"kind": "array", "shape": list(x.shape), "dtype": str(x.dtype)}
    return {"kind": type(x).__name__}


def signature(state: Any) -> list[tuple[str, dict]]:
    """`[(keystr path, leaf signature)]` of every leaf of `state`, in flattening order."""
    leaves, _ = tree_flatten_with_path(state, is_leaf=_is_layout)
    return [(keystr(path), _leaf_signature(x)) for path, x in leaves]


def same_state(fn: str, state: Any) -> None:
    """Returns once every process traced `fn` with a state of this signature.

    Called at trace time of a step. Does nothing in a single-process job, and nothing
    for a signature every process already agreed on. Every process must trace its
    distinct state signatures in the same order (as SPMD programs do).

    Args:
      fn: the public function tracing the step ("value_and_grad"), for messages.
      state: the state the step is traced with.

    Raises:
      DistributedError: on every process, when some process traced a state that
        differs in structure, a shape, a dtype, its sharded layout or its
        mixed-precision policy; or a process left the job before tracing it.
    """
    client = _jax_compat.coordination_client()
    count = jax.process_count()
    if client is None or count < 2:
        return
    mine = signature(state)
    text = json.dumps(mine, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    if digest in _agreed:
        return
    start = time.perf_counter()
    root = f"{_ROOT}{next(_checks)}/"
    with _departures.python_wait():
        agreed = _key_value.agree_on_digest(client, root, digest, _deadline(), _left_before_trace)
    logger.debug(
        "%s: state signature %s compared across %d processes in %.1f ms",
        fn,
        digest[:8],
        count,
        (time.perf_counter() - start) * 1e3,
    )
    if agreed is not False:  # None: the others are late; they will raise if it differs
        _agreed.add(digest)
        return
    with _departures.python_wait():
        texts = _key_value.exchange_texts(client, root, text, _deadline(), _left_before_trace)
    theirs = {rank: [(p, d) for p, d in json.loads(value)] for rank, value in texts.items()}
    _departures.announce_failure()
    _departures.await_failures(range(count))
    raise errors.DistributedError(_states_differ(fn, theirs))


def _deadline() -> float:
    return time.monotonic() + _departures.wait_limit()


def _left_before_trace() -> str | None:
    """The error once some process left the job (None while none has)."""
    left = _departures.departed()
    if not left:
        return None
    notes = "; ".join(_departures.departure_text(n) for _, n in sorted(left.items()))
    return (
        f"value_and_grad: process {jax.process_index()} traced its step, but {notes} "
        "before tracing it: the step's collectives would never complete."
    )


def _describe(leaf: dict | None) -> str:
    """ "float32 (16, 4)", "float32 (16, 4) sharded on dim 0 with mp_policy ...", "absent"."""
    if leaf is None:
        return "absent"
    if "shape" not in leaf:
        return f"a {leaf['kind']}"
    text = f"{leaf['dtype']} {tuple(leaf['shape'])}"
    if leaf["kind"] == "array":
        return text + " (not sharded)"
    text += f" sharded on dim {leaf['dim']} over {tuple(leaf['shard_axis'])}"
    if leaf["replicate_axis"]:
        text += f" replicated over {tuple(leaf['replicate_axis'])}"
    if leaf["mp_policy"] is not None:
        text += f" with {leaf['mp_policy']}"
    return text


@dataclasses.dataclass(frozen=True)
class _Difference:
    path: str
    groups: dict[str, list[int]]  # leaf description -> the ranks that have it


def _differences(signatures: dict[int, list]) -> list[_Difference]:
    """Every leaf whose signature is not the same on every process, in rank 0's order."""
    by_rank = {rank: dict(leaves) for rank, leaves in signatures.items()}
    paths = list(dict.fromkeys(p for leaves in signatures.values() for p, _ in leaves))
    found = []
    for path in paths:
        groups: dict[str, list[int]] = {}
        for rank, leaves in by_rank.items():
            groups.setdefault(_describe(leaves.get(path)), []).append(rank)
        if len(groups) > 1:
            found.append(_Difference(path, groups))
    return found


def _states_differ(fn: str, signatures: dict[int, list]) -> str:
    found = _differences(signatures)
    if not found:  # same leaves, another order: the structure differs
        return (
            f"{fn}: the processes traced the step with states of different structures "
            "(the same leaves in another order). Build the same model on every process."
        )
    first = found[0]
    listing = "; ".join(f"{d} on {_text.process_list(r)}" for d, r in first.groups.items())
    more = f" ({len(found) - 1} more leaves differ)" if len(found) > 1 else ""
    return (
        f"{fn}: the processes traced the step with different states: leaf "
        f"state{first.path} is {listing}{more}. Every process must build the same model "
        "(same tree, shapes, dtypes, sharding and mp_policy): the step's collectives are "
        "sized by it, and processes with different sizes would abort in the first "
        "all-gather. Build the model from the same configuration on every process (e.g. "
        "the same vocabulary size, not one read from a process-local file)."
    )
