"""A throwaway PostgreSQL server for the chaos suite, which restarts it and kills its
connections: the machine's shared server is never touched."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

BINDIR_CANDIDATES = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


def _binary(name: str) -> str:
    """The server binary ``name``: Debian keeps ``initdb`` and ``pg_ctl`` off the PATH."""
    for bindir in BINDIR_CANDIDATES:
        if (bindir / name).exists():
            return str(bindir / name)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"{name} not found: install the PostgreSQL server package (Debian: postgresql)"
        )
    return found


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ThrowawayPostgres:
    """A PostgreSQL server in a temporary directory, on its own port, trust auth.

    PostgreSQL refuses to run as root, so as root the server runs as the ``postgres``
    user, which owns the directory.
    """

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fair-jobs-chaos-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            shutil.chown(self.dir, self.user)

    def _run(self, *args: str) -> None:
        cmd = [*args] if self.user is None else ["runuser", "-u", self.user, "--", *args]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            log = self.log.read_text(errors="replace") if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout}{result.stderr}{log}")

    def init(self) -> None:
        """Create the cluster: no fsync (a test server), room for many workers."""
        self._run(_binary("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        options = (
            f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
            f"unix_socket_directories = '{self.dir}'\nmax_connections = 200\n"
            "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
        )
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(options)

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "start")

    def stop(self) -> None:
        """Stop it at once: connections are cut, as in a crash of the server's clients."""
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        """Stop and start again on the same port and data: every connection is cut."""
        self._run(
            _binary("pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-m",
            "fast",
            "-w",
            "restart",
        )

    def url(self, dbname: str = "postgres") -> str:
        """The connection URL of database ``dbname``."""
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def destroy(self) -> None:
        """Stop the server if it runs and delete its directory."""
        with contextlib.suppress(RuntimeError):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
