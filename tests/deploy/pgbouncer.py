"""A throwaway PgBouncer in transaction pooling mode, in front of the test database, that a
test can stop and start again on the same port (see ``tests/deploy/test_pgbouncer.py``).

Debian's ``pgbouncer`` package provides the binary (``bash scripts/test.sh`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

INSTALL_HINT = (
    "pgbouncer is not installed: tests/deploy/test_pgbouncer.py needs it "
    "(apt-get install pgbouncer, or run bash scripts/test.sh, which installs it)"
)

POOL_SIZE = 4
"""Server connections per database and user: fewer than the workers' client connections,
so that clients share server connections, as in production; with one server connection per
client, a statement that relied on its session would never see the difference."""

PORT_ENV = "FAIR_JOBS_PGBOUNCER_PORT"
"""Set it to the port PgBouncer should listen on; unset, the tests pick a free one."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class PgBouncer:
    """One ``pgbouncer`` process (``pool_mode = transaction``, trust auth) forwarding every
    database name to the PostgreSQL server at ``server_host``:``server_port``."""

    directory: Path
    server_host: str
    server_port: int
    port: int = field(default_factory=lambda: int(os.environ.get(PORT_ENV) or free_port()))
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def ini(self) -> Path:
        return self.directory / "pgbouncer.ini"

    @property
    def log(self) -> Path:
        return self.directory / "pgbouncer.log"

    def url(self, database: str, user: str = "postgres") -> str:
        """A DATABASE_URL that reaches ``database`` through this PgBouncer."""
        return f"postgres://{user}@127.0.0.1:{self.port}/{database}"

    def write_config(self) -> None:
        """The ini and the auth file; PgBouncer reads both at start, before it drops root."""
        self.directory.mkdir(parents=True, exist_ok=True)
        users = self.directory / "userlist.txt"
        users.write_text('"postgres" ""\n')
        self.ini.write_text(
            "[databases]\n"
            f"* = host={self.server_host} port={self.server_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {POOL_SIZE}\n"
            "max_client_conn = 500\n"
            "admin_users = postgres\n"
        )

    def start(self, timeout: float = 20) -> None:
        """Start the process and wait until a client gets through to PostgreSQL."""
        binary = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
        assert binary, INSTALL_HINT
        if not self.ini.exists():
            self.write_config()
        cmd = [binary, str(self.ini)]
        if os.geteuid() == 0:
            cmd[1:1] = ["-u", "nobody"]  # PgBouncer refuses to run as root
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"pgbouncer exited:\n{self.log.read_text()}"
            try:
                with psycopg.connect(self.url("postgres"), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def transactions(self, database: str) -> int:
        """How many transactions PgBouncer carried to ``database`` since it started (its
        admin console's ``SHOW STATS``), to tell that the clients went through it."""
        # The admin console speaks the simple query protocol only: a client-side cursor
        # sends a statement without parameters that way.
        with psycopg.connect(
            self.url("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor
        ) as conn:
            cursor = conn.execute("SHOW STATS")
            names = [column.name for column in cursor.description or []]
            for row in cursor.fetchall():
                stats = dict(zip(names, row, strict=True))
                if stats["database"] == database:
                    return int(stats["total_xact_count"])
        return 0

    def stop(self) -> None:
        """Stop at once (SIGTERM, PgBouncer's fast exit): every client and server
        connection is cut, whatever runs on it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        """Stop, then start again on the same port."""
        self.stop()
        self.start()
