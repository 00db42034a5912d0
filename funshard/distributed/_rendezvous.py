"""Start-up rendezvous: every process meets process 0 on the coordinator's port first.

Why it exists, measured again with jax 0.10.2 on CPU: one process of a 2-process job
alone on 127.0.0.1 calling `jax.distributed.initialize(f"127.0.0.1:{port}",
num_processes=2, process_id=0 (then 1), initialization_timeout=5,
cluster_detection_method="deactivate")` inside `try/except BaseException` printed
nothing while it waited, then after 11 s (about twice the timeout) ended with

    F... client.h:80] Terminating process because the JAX distributed service detected
    fatal errors. This most likely indicates that another task died; see the other task
    logs for more details. ... absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded
    RPC: /xla.coordination.CoordinationService/RegisterTask
    *** Check failure stack trace: *** ... xla::CoordinationServiceAgent::Connect() ...

and exit status 134 (SIGABRT from LOG(FATAL) in C++): no Python exception (the except
clause never ran), no traceback, and nobody named. Process 1 without a process 0 did the
same, and so did both with `jax_enable_recoverability` on. None of
`jax.distributed.initialize`'s options (`initialization_timeout`,
`heartbeat_timeout_seconds`, `shutdown_timeout_seconds`) changes that.

So the processes first meet over a plain TCP socket on the same port, where a timeout
is a Python exception naming who is missing; process 0 then closes its listening socket
and JAX's service binds the port. Each process sends one line "funshard-start <rank>
<num_processes>"; process 0 answers "go" once all have arrived, or "missing <ranks>" /
"error <text>".

After "go" the connections stay open as liveness links (`funshard.distributed._links`):
process 0 keeps one to every other process, each other process its one to process 0.
JAX's service still binds the port (measured on jax 0.10.2: the accepted connections
do not block it; only a listening socket would).
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
import time

from funshard import _text, errors

# A start-up this quick stays silent; a longer one says once what it waits for.
WAIT_NOTICE_S = 1.0

_HELLO = "funshard-start"
_ANSWER_SLACK_S = 1.0  # network and scheduling delay allowed for process 0's answer


def meet(rank: int, n: int, host: str, port: int, timeout: float) -> dict[int, socket.socket]:
    """Returns once all `n` processes have reached process 0 at `host:port`.

    Args:
      rank: this process's rank; rank 0 listens, the others connect.
      n: processes in the job.
      host: the coordinator's host (process 0's), already resolved once by `endpoint`.
      port: the coordinator's port, which JAX's service binds once this returns.
      timeout: seconds to wait for every process, from this call on.

    Returns:
      The open connections, non-blocking, by the rank at their other end: on process 0
      one per other process, elsewhere the one to process 0 (the liveness links).

    Raises:
      TimeoutError: within `timeout` s some processes never arrived (named by rank)
        or process 0 was not reached.
      RuntimeError: process 0 cannot listen on `port`, or it rejected this process.
    """
    start = time.monotonic()
    if rank == 0:
        links = _serve(n, host, port, start, timeout)
    else:
        links = {0: _join(rank, n, host, port, start, timeout)}
    for link in links.values():
        link.setblocking(False)
    return links


def _me(rank: int, n: int) -> str:
    return f"process {rank} of {n}"


def _notice(text: str) -> None:
    print(f"funshard: {text}", file=sys.stderr, flush=True)


def _listen(port: int) -> socket.socket:
    # Bind where JAX's service will: JAX_COORDINATOR_BIND_ADDRESS, else the same port
    # on every interface ("[::]:port"), so whoever reaches one reaches the other.
    host, _, bind_port = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").rpartition(":")
    host, port = host.strip("[]"), int(bind_port) if bind_port.isdigit() else port
    if host in ("", "::") and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _start_cannot_listen(port: int, reason: object) -> str:
    return (
        f"initialize: process 0 cannot listen on port {port} for the coordinator "
        f"({reason}); another program uses it. Choose a free port: a MASTER_PORT whose "
        "next port is free too (JAX's coordinator listens on MASTER_PORT + 1), or the "
        "port in coordinator_address."
    )


def _start_missing_processes(
    me: str, missing: list[int], address: str, timeout: float, notes: list[str]
) -> str:
    extra = "".join(f" {note}." for note in notes)
    return (
        f"initialize: {me} gave up after {timeout:g} s: {_text.process_list(missing)} never "
        f"reached the coordinator at {address}.{extra} Check that the launcher started "
        "every process with the same WORLD_SIZE and MASTER_ADDR/MASTER_PORT, or raise the "
        "timeout (initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
    )


def _serve(n: int, host: str, port: int, start: float, timeout: float) -> dict[int, socket.socket]:
    """Process 0: waits for every other rank's hello, answers all of them at once.

    Returns the connections by rank once all arrived (closes them all otherwise).
    """
    address, me = f"{host}:{port}", _me(0, n)
    try:
        server = _listen(port)
    except OSError as exc:
        raise errors.DistributedError(_start_cannot_listen(port, exc.strerror or exc)) from None
    arrived: dict[int, socket.socket] = {}
    kept: set[socket.socket] = set()  # the links, once every process arrived
    notes: list[str] = []
    with server, selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ, None)
        try:
            noticed = False
            while len(arrived) < n - 1 and time.monotonic() - start < timeout:
                if not noticed and time.monotonic() - start >= WAIT_NOTICE_S:
                    missing = sorted(set(range(1, n)) - set(arrived))
                    _notice(
                        f"{me} waiting for {_text.process_list(missing)} "
                        f"at {address}, timeout {timeout:g} s"
                    )
                    noticed = True
                for key, _ in selector.select(0.2):
                    _on_readable(key, server, selector, arrived, notes, n)
            missing = sorted(set(range(1, n)) - set(arrived))
            reply = f"missing {','.join(map(str, missing))}" if missing else "go"
            for peer in arrived.values():
                _send_line(peer, reply)
            if not missing:
                kept = set(arrived.values())
        finally:
            for key in list(selector.get_map().values()):
                held = key.fileobj
                if isinstance(held, socket.socket) and held is not server and held not in kept:
                    held.close()
    if missing:
        raise errors.DistributedTimeoutError(
            _start_missing_processes(me, missing, address, timeout, notes)
        )
    return arrived


def _start_note_refused(problem: str) -> str:
    """A note for `start_missing_processes`: a connection process 0 turned away."""
    return f"Refused a connection: {problem}"


def _start_note_disconnected(rank: int) -> str:
    """A note for `start_missing_processes`: a peer that arrived, then died."""
    return f"Process {rank} arrived but disconnected again (it exited)"


def _start_rejected(n: int, problem: str) -> str:
    return (
        f"initialize: process 0 of {n} rejected this process: {problem}. Start every "
        "process with the same WORLD_SIZE and its own RANK, and keep other programs off "
        "the coordinator's port."
    )


def _on_readable(
    key: selectors.SelectorKey,
    server: socket.socket,
    selector: selectors.BaseSelector,
    arrived: dict[int, socket.socket],
    notes: list[str],
    n: int,
) -> None:
    if key.fileobj is server:
        accepted, _ = server.accept()
        accepted.setblocking(False)
        selector.register(accepted, selectors.EVENT_READ, b"")
        return
    peer = key.fileobj
    if not isinstance(peer, socket.socket):  # only sockets are registered
        return
    try:
        data = key.data + peer.recv(256)
    except OSError:
        data = b""
    selector.unregister(peer)
    if b"\n" not in data:
        if data and len(data) < 256:  # the rest of the line is still on its way
            selector.register(peer, selectors.EVENT_READ, data)
            return
        # Gone before (or without) a hello: a peer that died, or not funshard at all.
        for rank in [r for r, s in arrived.items() if s is peer]:
            del arrived[rank]
            notes.append(_start_note_disconnected(rank))
        peer.close()
        return
    problem, rank = _check_hello(data.split(b"\n", 1)[0], arrived, n)
    if problem:
        notes.append(_start_note_refused(problem))
        _send_line(peer, f"error {_start_rejected(n, problem)}")
        peer.close()
        return
    arrived[rank] = peer
    selector.register(peer, selectors.EVENT_READ, b"")  # to notice if it dies meanwhile


def _hello_not_funshard() -> str:
    return "a program other than funshard connected to the coordinator's port"


def _hello_world_size(rank: int, size: int, n: int) -> str:
    return (
        f"a process started as rank {rank} of {size} processes, but process 0 expects "
        f"{n} (WORLD_SIZE differs between processes)"
    )


def _hello_rank_taken(rank: int) -> str:
    return f"two processes started as rank {rank} (RANK must be unique)"


def _check_hello(line: bytes, arrived: dict, n: int) -> tuple[str | None, int]:
    parts = line.decode(errors="replace").split()
    if len(parts) != 3 or parts[0] != _HELLO or not all(p.isdigit() for p in parts[1:]):
        return _hello_not_funshard(), -1
    rank, size = int(parts[1]), int(parts[2])
    if size != n:
        return _hello_world_size(rank, size, n), rank
    if rank in arrived:
        return _hello_rank_taken(rank), rank
    return None, rank


def _send_line(peer: socket.socket, text: str) -> None:
    try:
        peer.setblocking(True)
        peer.sendall(text.encode() + b"\n")
    except OSError:
        pass  # it is gone; nothing to tell


def _start_no_coordinator(me: str, address: str, timeout: float, reason: str) -> str:
    return (
        f"initialize: {me} could not reach the coordinator (process 0) at {address} "
        f"within {timeout:g} s ({reason}). Start process 0, check that MASTER_ADDR / "
        "MASTER_PORT (or coordinator_address) name its host and a port it can listen on, "
        "or raise the timeout (initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
    )


def _join(rank: int, n: int, host: str, port: int, start: float, timeout: float) -> socket.socket:
    """Any other process: says hello to process 0, waits for "go"; returns the connection."""
    address, reason, noticed = f"{host}:{port}", "nothing listens there", False
    me = _me(rank, n)
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            raise errors.DistributedTimeoutError(
                _start_no_coordinator(me, address, timeout, reason)
            )
        if not noticed and time.monotonic() - start >= WAIT_NOTICE_S:
            _notice(
                f"{me} waiting for process 0 (the coordinator) and the "
                f"others at {address}, timeout {timeout:g} s"
            )
            noticed = True
        try:
            peer = socket.create_connection((host, port), timeout=min(left, 1.0))
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            time.sleep(min(0.2, max(left, 0)))
            continue
        try:
            reply = _await_reply(peer, rank, n, start, timeout, noticed, address)
            if reply is not None:
                _on_reply(reply, me)
                return peer
        except BaseException:
            peer.close()
            raise
        peer.close()
        reason = "process 0 closed the connection without an answer"


def _start_no_answer(me: str, address: str, timeout: float) -> str:
    return (
        f"initialize: {me} reached the coordinator at {address}, but process 0 did not "
        f"answer within {timeout:g} s (is it stopped?). Check process 0's log, or raise "
        "the timeout (initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
    )


def _await_reply(
    peer: socket.socket,
    rank: int,
    n: int,
    start: float,
    timeout: float,
    noticed: bool,
    address: str,
) -> str | None:
    """Process 0's one-line answer, or None if the connection closed before it.

    Process 0 started before this connection and answers by its own deadline, so its
    clock decides (its answer names the missing processes); the bound here only guards
    against a process 0 that hangs.
    """
    deadline = time.monotonic() + timeout + _ANSWER_SLACK_S
    me = _me(rank, n)
    try:
        peer.sendall(f"{_HELLO} {rank} {n}\n".encode())
    except OSError:
        return None
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise errors.DistributedTimeoutError(_start_no_answer(me, address, timeout))
        if not noticed and time.monotonic() - start >= WAIT_NOTICE_S:
            _notice(f"{me} waiting for the other processes at {address}, timeout {timeout:g} s")
            noticed = True
        peer.settimeout(min(left, 0.2))
        try:
            chunk = peer.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def _start_gave_up_elsewhere(me: str, missing: list[int]) -> str:
    return (
        f"initialize: {me}: process 0 gave up waiting: {_text.process_list(missing)} never "
        "reached the coordinator (see process 0's error). Start the missing processes, "
        "or raise the timeout (initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
    )


def _start_unexpected_answer(reply: str) -> str:
    return (
        f"initialize: unexpected answer {reply!r} from the coordinator's port; run the "
        "same funshard version in every process and keep other programs off that port."
    )


def _on_reply(reply: str, me: str) -> None:
    word, _, rest = reply.partition(" ")
    if word == "go":
        return
    if word == "missing":
        raise errors.DistributedTimeoutError(
            _start_gave_up_elsewhere(me, [int(r) for r in rest.split(",")])
        )
    raise errors.DistributedError(rest if word == "error" else _start_unexpected_answer(reply))
