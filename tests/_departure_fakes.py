"""A stand-in for JAX's coordination service, for the in-process departure tests."""

from __future__ import annotations

import time

from funshard import comm


class FakeService:
    """The coordination service's key-value store, as the departure notes use it."""

    def __init__(self) -> None:
        self.kv: dict[str, str] = {}

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if key in self.kv and not allow_overwrite:  # as JAX's: "ALREADY_EXISTS: key ..."
            raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
        self.kv[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        time.sleep(timeout_ms / 1000)
        raise RuntimeError("DEADLINE_EXCEEDED")

    def leave(
        self,
        rank: int,
        step: int,
        kind: str = "shard_batch call",
        how: str = "returned normally",
        barrier: bool = True,
    ) -> None:
        """Posts process `rank`'s departure note, as that process would."""
        note = comm.Note(rank, step, kind, how, barrier=barrier)
        self.kv[f"funshard/left/{rank}"] = note.text()


def fake_lifecycle_service(monkeypatch) -> tuple[FakeService, list[int]]:
    """A fresh `FakeService` as the coordination service of `funshard.distributed`'s
    lifecycle, with no lifecycle or board started yet and its exits recorded, not taken."""
    from funshard.comm import _departures
    from funshard.distributed import _lifecycle

    exits: list[int] = []
    monkeypatch.setattr(_lifecycle, "_exit_now", exits.append)
    monkeypatch.setattr(_lifecycle, "_current", None)
    monkeypatch.setattr(_departures, "_board", None)
    service = FakeService()
    monkeypatch.setattr(_lifecycle._jax_compat, "coordination_client", lambda: service)
    return service, exits
