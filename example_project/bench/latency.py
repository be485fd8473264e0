"""A TCP proxy that delays what passes through it, so that a benchmark run shows what a
database across a network costs (``fairbench --db-latency-ms N``).

Every chunk read from either side is written to the other ``N`` ms later, in order, as a
network link with that one-way latency would deliver it: a round trip costs ``2N`` ms
more, and chunks sent back to back overlap their delays (no bandwidth limit). It runs as
a process of its own (``python -m bench.latency``), so that its work does not take the
benchmark publisher's interpreter lock; :class:`Proxy` starts and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while True:
            data = await reader.read(65536)
            await chunks.put((loop.time() + delay, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await chunks.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, OSError):
        writer.close()


async def _serve(target_host: str, target_port: int, delay: float) -> None:
    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer, delay), _pipe(up_reader, writer, delay))

    server = await asyncio.start_server(client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)  # the parent reads the port it listens on
    async with server:
        await server.serve_forever()


class Proxy:
    """The proxy as a child process: ``port`` is where it listens (on 127.0.0.1)."""

    def __init__(self, target_host: str, target_port: int, delay_ms: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.latency", target_host, str(target_port), str(delay_ms)],
            cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the latency proxy did not start ({line!r})")
        self.port = int(line)

    def stop(self) -> None:
        """Stop the proxy (its connections drop)."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    """``python -m bench.latency HOST PORT DELAY_MS``: print the port, then proxy."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("delay_ms", type=float)
    options = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(options.host, options.port, options.delay_ms / 1000))


if __name__ == "__main__":
    main()
