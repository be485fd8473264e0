"""Real faults for tests: a TCP proxy in front of the broker that can stop answering."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit, urlunsplit


class SilentProxy:
    """A TCP proxy to ``target_url``'s host and port. :meth:`go_silent` stops it relaying
    in both directions while every connection stays open: a broker (or a network path)
    that stops answering, where a client's writes succeed and its reads wait. A refused
    connection would fail fast; this is the fault that blocks a publisher for as long as
    its timeouts allow. :meth:`answer` resumes relaying, with nothing lost."""

    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._parts = parts
        self._relaying = threading.Event()
        self._relaying.set()
        self._closed = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = [self._server]
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        """``target_url`` with the proxy's address in place of the broker's."""
        auth = self._parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urlunsplit(self._parts._replace(netloc=netloc))

    def go_silent(self) -> None:
        """Stop relaying: every connection stays open and nothing is answered."""
        self._relaying.clear()

    def answer(self) -> None:
        """Relay again, including what was sent while silent."""
        self._relaying.set()

    def close(self) -> None:
        """Close every connection and stop accepting."""
        self._closed.set()
        self._relaying.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self._target)
            except OSError:
                return
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            # Not reading while silent: what the peer sends waits in the socket buffers.
            self._relaying.wait()
            if self._closed.is_set():
                return
            try:
                src.settimeout(0.1)
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            self._relaying.wait()
            try:
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
