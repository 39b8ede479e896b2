"""The SSD worker process as the node runs it: spawned with its settings on stdin and
the DRAM arena's descriptor, its stderr forwarded to the node's log, its requests sent
through :class:`~kvpool.server.cold.worker_channel.WorkerChannel`, stopped by closing
that socket (the worker exits on EOF)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from kvpool.protocol.worker import WorkerSettings
from kvpool.server.cold.worker_channel import SsdUnavailableError, WorkerChannel

__all__ = ["WorkerProcess"]

log = logging.getLogger("kvpool.ssd")


class WorkerProcess:
    """``on_lost(exc)``: the socket to the worker ended (it died, or was stopped)."""

    def __init__(self, path: Path, settings: WorkerSettings, *, arena_fd: int,
                 arena_size: int, on_lost: Callable[[Exception | None], object]) -> None:
        self.path = path
        self.settings = settings
        self._arena_fd = arena_fd
        self._arena_size = arena_size
        self._on_lost = on_lost
        self.proc: asyncio.subprocess.Process | None = None
        self._channel: WorkerChannel | None = None
        self._stderr_task: asyncio.Task[None] | None = None

    async def spawn(self) -> None:
        """Start the worker and connect to it (it answers once it has opened its tiers)."""
        parent, child = socket.socketpair()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvpool.server.cold.ssd_worker", "--path", str(self.path),
            "--arena-fd", str(self._arena_fd), "--arena-size", str(self._arena_size),
            "--sock-fd", str(child.fileno()), "--parent-pid", str(os.getpid()),
            pass_fds=(self._arena_fd, child.fileno()), stdin=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        child.close()
        assert self.proc.stdin is not None
        self.proc.stdin.write(self.settings.encode())
        self.proc.stdin.close()  # EOF: the worker has all of its settings
        loop = asyncio.get_running_loop()
        _, self._channel = await loop.create_unix_connection(
            lambda: WorkerChannel(self._on_lost), sock=parent)

    @property
    def forwarding(self) -> bool:
        """The worker started: its stderr goes to the node's log."""
        return self._stderr_task is not None

    def forward_stderr(self) -> None:
        self._stderr_task = asyncio.create_task(self._forward_stderr())

    async def _forward_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            log.warning("%s", line.decode(errors="replace").rstrip())

    async def stderr_text(self) -> str:
        """What a worker that has exited printed (why it did not start)."""
        if self.proc is None or self.proc.stderr is None or self.forwarding:
            return ""
        return (await self.proc.stderr.read()).decode(errors="replace").strip()

    def call(self, op: int, key: bytes, offset: int, length: int
             ) -> asyncio.Future[tuple[int, bytes]]:
        if self._channel is None:
            raise SsdUnavailableError("the SSD worker is not running")
        return self._channel.call(op, key, offset, length)

    async def stop(self) -> None:
        """Close the socket and wait for the worker to exit (killed after 30 s)."""
        if self._channel is not None:
            self._channel.close()  # the worker exits on EOF
        if self.proc is not None and self.proc.returncode is None:
            try:
                async with asyncio.timeout(30):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stderr_task
