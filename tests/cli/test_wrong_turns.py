"""Wrong turns a new user takes, each answered by one line that names the fix, exit 2 and
no traceback: the data port and the admin port mixed up (both ways, from the CLI and the
SDK), a busy port, a file for a data dir, more DRAM than the machine has."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvpool.cli.local_cluster import free_port_run
from kvpool.client import Client
from kvpool.protocol.errors import KvpoolError
from tests.cluster.test_cluster import kvpool_cli
from tests.conftest import NodeProcess

BIG = "100TiB"  # more memory than any machine this runs on


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return kvpool_cli(*args, columns=80)  # a narrow terminal: tables must still fit


def refused(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """The command's one-line refusal: exit 2, no traceback, each word in it."""
    out = result.stderr + result.stdout
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    for word in words:
        assert word in out, out
    return out


def test_the_admin_commands_at_the_data_port_say_which_port_is_which(
        node: NodeProcess) -> None:
    admin_port = node.admin_url.rsplit(":", 1)[1]
    out = refused(kvpool("stats", "--admin", f"http://127.0.0.1:{node.port}"),
                  "data port", f"http://127.0.0.1:{admin_port}")
    assert len(out.strip().splitlines()) == 1
    # as curl sees it: an HTTP 400 in the admin API's error shape
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"http://127.0.0.1:{node.port}/v1/stats", timeout=10)
    assert caught.value.code == 400
    assert json.load(caught.value)["error"]["type"] == "wrong_port"
    # the data address itself, as the SDK takes it
    refused(kvpool("stats", "--admin", f"kvpool://127.0.0.1:{node.port}"),
            "is a data address", "admin URL")


def test_the_sdk_at_the_admin_port_says_it_is_one(node: NodeProcess) -> None:
    admin = node.admin_url.removeprefix("http://")
    with pytest.raises(KvpoolError, match="admin port, not a data port"), \
            Client(f"kvpool://{admin}", shm=False, timeout=10) as c:
        c.get(bytes(16))


def test_the_status_table_keeps_the_hit_rate_whole_in_80_columns(node: NodeProcess) -> None:
    with Client(node.url) as c:
        c.put(b"w" * 16, b"x")
        assert c.get(b"w" * 16) == b"x"
    result = kvpool("status", "--admin", node.admin_url)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout and "%" in result.stdout, result.stdout


def test_a_busy_port_names_the_flag_that_moves_it(tmp_path: Path) -> None:
    # the first of 4 free ports below the ephemeral range, held: with port 0's port (in
    # that range, where connections take ports) the test failed once beside other
    # modules, its output not kept; a taken neighbour is the likely cause
    port = free_port_run(4)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        refused(kvpool("cluster", "up", "--nodes", "2", "--base-port", str(port),
                       "--data-dir", str(tmp_path / "c")), f"port {port}", "--base-port")
        refused(kvpool("serve", "--nodes", "2", "--data-port", str(port), "--admin-port",
                       str(port + 1), "--data-dir", str(tmp_path / "s")),
                f"{port}", "--data-port")
    assert not (tmp_path / "c" / "n0").exists() and not (tmp_path / "s" / "n0").exists()


def test_a_file_given_as_data_dir_is_named(tmp_path: Path) -> None:
    afile = tmp_path / "not-a-dir"
    afile.write_text("")
    refused(kvpool("serve", "--data-dir", str(afile), "--data-port", "0", "--admin-port", "0"),
            "is a file", "give a directory")
    refused(kvpool("cluster", "up", "--base-port", "0", "--data-dir", str(afile)),
            "is a file", "give a directory")


def test_more_dram_than_the_machine_has_is_refused_before_starting(tmp_path: Path) -> None:
    refused(kvpool("serve", "--dram-capacity", BIG, "--data-dir", str(tmp_path / "one"),
                   "--data-port", "0", "--admin-port", "0"),
            "more than the memory this node may use", "--dram-capacity")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    each = f"{total // 2 + (1 << 30)}"  # fits one node, not three
    refused(kvpool("cluster", "up", "--nodes", "3", "--base-port", "0", "--dram-capacity", each,
                   "--data-dir", str(tmp_path / "three")),
            "3 nodes", "more than the memory they may use")
    assert not (tmp_path / "three" / "n0").exists()
