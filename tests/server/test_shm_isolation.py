"""Descriptors of the arena handed out read-only stay read-only; tenants get none at all.

Each test takes the fast path's descriptors the way an attacker would: raw HELLO over TCP,
then the ticket on the node's Unix socket and the descriptors out of SCM_RIGHTS.
"""

from __future__ import annotations

import array
import json
import mmap
import os
import socket
import struct
import sys
from collections.abc import Iterator

import pytest

from kvpool.client import Client, KvpoolConnectionError
from kvpool.protocol.host import host_id
from tests.conftest import NodeProcess, start_node, tokens_file

FRAME = struct.Struct("<2sBBIIIQ")
NOBODY = 65534


def take_descriptors(node: NodeProcess, token: str | None = None,
                     as_uid: int | None = None) -> tuple[dict[str, object], bytes, list[int]]:
    """(the HELLO reply, the grant answer, the descriptors passed); ``as_uid``: ask for the
    grant as that user (the caller must be root)."""
    hello = {"protocol": 1, "shm": True, "host": host_id()}
    if token:
        hello["token"] = token
    body = json.dumps(hello).encode()
    with socket.create_connection((node.host, node.port), timeout=5) as s:
        s.sendall(FRAME.pack(b"KV", 1, 0, 1, 0, 0, len(body)) + body)
        head = _recv_exact(s, FRAME.size)
        reply = json.loads(_recv_exact(s, FRAME.unpack(head)[6]))
        offer = reply.get("shm")
        if not isinstance(offer, dict) or "refused" in offer:
            return reply, b"", []
        if as_uid is not None:
            os.setresuid(as_uid, as_uid, 0)  # the kernel reads these at connect()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as u:
                u.connect("\0" + str(offer["socket"]))
                u.sendall(str(offer["ticket"]).encode())
                fds = array.array("i")
                answer, ancillary, _, _ = u.recvmsg(64, socket.CMSG_SPACE(4 * fds.itemsize))
                for level, kind, data in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        finally:
            if as_uid is not None:
                os.setresuid(0, 0, 0)
    return reply, answer, list(fds)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "the node closed the connection"
        data += chunk
    return data


def _writable(fd: int) -> str | None:
    """How ``fd``'s file could be written by this process (None: it cannot)."""
    try:
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    except PermissionError:
        return None
    try:
        size = os.fstat(rw).st_size
        try:
            with mmap.mmap(rw, size, prot=mmap.PROT_READ | mmap.PROT_WRITE):
                return "reopened O_RDWR and mapped writable"
        except PermissionError:
            pass
        try:
            os.pwrite(rw, b"x", 0)
            return "reopened O_RDWR and written"
        except PermissionError:
            return None
    finally:
        os.close(rw)


@pytest.fixture
def open_node() -> Iterator[NodeProcess]:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--shm-allow",
                      f"uid:{os.getuid()},uid:{NOBODY}", "--no-shm-write")
    yield node
    node.stop()


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux",
                    reason="acting as another user needs root")
def test_another_users_read_only_descriptors_cannot_be_reopened_for_writing(
        open_node: NodeProcess) -> None:
    with Client(open_node.url) as c:
        c.put(b"v" * 16, b"victim" * 1000)
    pid = os.fork()
    if pid == 0:  # the attacker: another user, allowed to map the arena read-only
        code = 1
        try:
            _, answer, fds = take_descriptors(open_node, as_uid=NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            ways = [_writable(fd) for fd in fds]
            code = 0 if answer == b"OK" and len(fds) == 2 and ways == [None, None] else 3
            if code:
                print(f"answer {answer!r}, {len(fds)} descriptors, writable: {ways}",
                      flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with Client(open_node.url, shm=False) as c:
        assert c.get(b"v" * 16) == b"victim" * 1000


def test_the_index_refuses_every_writable_mapping_even_its_owners(
        open_node: NodeProcess) -> None:
    """The node's own user (root here, in CI) can reopen the index file, but the seal
    refuses it a writable mapping and writes."""
    _, answer, fds = take_descriptors(open_node)
    try:
        assert answer == b"OK" and len(fds) == 2
        index_fd = fds[1]
        rw = os.open(f"/proc/self/fd/{index_fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(rw, os.fstat(rw).st_size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"x", 0)
            with pytest.raises(PermissionError):  # nor can it be shrunk under the node
                os.ftruncate(rw, 0)
        finally:
            os.close(rw)
        assert os.fstat(fds[0]).st_mode & 0o777 == 0o600  # the arena: the node's alone
    finally:
        for fd in fds:
            os.close(fd)


def test_non_admin_tenants_are_never_offered_the_arena() -> None:
    """A tenant process of the node's own user owns the arena's file: a read-only
    descriptor would be one fchmod away from writing another tenant's chunks."""
    path = tokens_file({"acme-writer-0123456789": ("acme", "write"),
                        "ops-admin-000123456789": ("ops", "admin")})
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--auth-tokens", path)
    try:
        reply, answer, fds = take_descriptors(node, token="acme-writer-0123456789")
        assert reply["tenant"] == "acme" and fds == []
        assert "only admin tokens may map the arena" in reply["shm"]["refused"]
        _, answer, fds = take_descriptors(node, token="ops-admin-000123456789")
        assert answer.startswith(b"OK") and fds  # admins keep the fast path
        for fd in fds:
            os.close(fd)
        value = os.urandom(1 << 20)
        with pytest.raises(KvpoolConnectionError, match="only admin tokens may map"), \
                Client(node.url, token="acme-writer-0123456789", shm=True) as acme:
            acme.exists_many([b"a" * 16])
        with Client(node.url, token="acme-writer-0123456789") as acme:  # shm: if offered
            acme.put(b"a" * 16, value)
            assert acme.get(b"a" * 16) == value
            assert acme.bytes_by_path == {"shm": 0, "tcp": len(value)}
    finally:
        node.stop()
