"""Liveness links: the start-up connections, kept open to notice a process's death at once.

A process that dies without running its exit (SIGKILL, the out-of-memory killer, a
segfault, an abort in C++) posts no departure note, and JAX's coordination service
declares it dead only after `heartbeat_timeout` (100 s by default). Meanwhile the
survivors' collectives fail with gloo's "Connection reset by peer", which names an
address, not a process. But the kernel closes a dead process's sockets at once, so the
connection it kept to process 0 since the rendezvous (`_rendezvous.meet`) ends within
milliseconds on both sides.

Every process writes "bye" on its links when it leaves through Python (its exit
handler, or `fail_fast`'s exit); a link that ends without it leads to a process that
died. A host that loses power or its network closes nothing: that death is still only
noticed by JAX's heartbeat.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import time
from collections.abc import Mapping

BYE = b"bye\n"


class Links:
    """This process's liveness links, by the rank at their other end.

    Not thread-safe: one thread at a time calls `dropped` (the liveness thread, then the
    exit handler once it has stopped that thread); `say_bye` may run on any thread.
    """

    def __init__(self, peers: Mapping[int, socket.socket]) -> None:
        self._peers = dict(peers)
        # A forked child (a data loader's worker) shares these sockets: only the process
        # that made them speaks for them.
        self._pid = os.getpid()
        self._said_bye = False
        self._selector = selectors.DefaultSelector()
        for rank, peer in self._peers.items():
            self._selector.register(peer, selectors.EVENT_READ, rank)

    def say_bye(self) -> None:
        """Tells every linked process that this one leaves through Python (once)."""
        if self._said_bye or os.getpid() != self._pid:
            return
        self._said_bye = True
        for peer in self._peers.values():
            with contextlib.suppress(OSError):  # a few bytes fit any empty send buffer
                peer.send(BYE)

    def dropped(self, timeout: float) -> list[int]:
        """Waits up to `timeout` s for news; returns the ranks whose link ended without bye.

        A rank is returned once: its link is not watched any more, nor one that said bye.
        """
        if not self._selector.get_map():
            time.sleep(timeout)
            return []
        died = []
        for key, _ in self._selector.select(timeout):
            peer, rank = key.fileobj, key.data
            assert isinstance(peer, socket.socket)
            try:
                data = peer.recv(64)
            except BlockingIOError:
                continue
            except OSError:  # "Connection reset by peer": it died with data unread
                data = b""
            if data and BYE not in data:
                continue  # nothing else is ever sent
            self._selector.unregister(peer)
            if not data:
                died.append(rank)
        return died

    def close(self) -> None:
        """Stops watching and closes every link (the process is leaving)."""
        self._selector.close()
        for peer in self._peers.values():
            peer.close()
