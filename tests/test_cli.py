"""The ``kvpool`` command as a user runs it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from kvpool.server.config import (
    ClusterConfig,
    DramConfig,
    S3Config,
    SecurityConfig,
    ServerConfig,
    SsdConfig,
)

from .conftest import NodeProcess, start_node


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.server", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_serve_help_documents_every_knob() -> None:
    out = kvpool("serve", "--help").stdout
    for cls in (ServerConfig, DramConfig, SsdConfig, S3Config, ClusterConfig, SecurityConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata["flag"] in out and f.metadata["env"] in out


def test_stats_json_and_table(node: NodeProcess) -> None:
    out = kvpool("stats", "--admin", node.admin_url, "--json")
    assert out.returncode == 0
    stats = json.loads(out.stdout)
    assert stats["capacity_bytes"] == 64 << 20 and "requests" in stats
    table = kvpool("stats", "--admin", node.admin_url)
    assert table.returncode == 0 and "DRAM used / capacity" in table.stdout


def test_stats_unreachable_node_exit_code() -> None:
    out = kvpool("stats", "--admin", "http://127.0.0.1:1", "--timeout", "2")
    assert out.returncode == 2 and "cannot reach" in out.stderr


def test_bad_flag_is_a_clear_error() -> None:
    out = kvpool("serve", "--dram-capacity", "lots")
    assert out.returncode == 2 and "not a size" in out.stderr


def test_embedded_default_prints_capacity() -> None:
    n = start_node()  # no capacity flag: a fraction of available memory
    try:
        assert n.proc.poll() is None
    finally:
        n.stop()


def test_healthz(node: NodeProcess) -> None:
    import urllib.request

    with urllib.request.urlopen(node.admin_url + "/healthz", timeout=5) as r:
        assert json.load(r)["status"] == "ok"


def test_health_probes_the_node_its_environment_describes(node: NodeProcess) -> None:
    import os

    port = node.admin_url.rsplit(":", 1)[1]
    env = {**os.environ, "KVPOOL_HOST": "0.0.0.0", "KVPOOL_ADMIN_PORT": port}
    ok = subprocess.run([sys.executable, "-m", "kvpool.server", "health"], env=env,
                        capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0 and ok.stdout.startswith("ok "), ok.stderr
    assert kvpool("health", "--url", node.admin_url.split("://")[1], "-q").returncode == 0
    down = kvpool("health", "--url", "127.0.0.1:1")
    assert down.returncode == 1 and down.stderr.count("\n") == 1
    assert "127.0.0.1:1/healthz" in down.stderr
    bad = subprocess.run([sys.executable, "-m", "kvpool.server", "health"],
                         env={**env, "KVPOOL_ADMIN_PORT": "x"}, capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "KVPOOL_ADMIN_PORT" in bad.stderr


def test_readme_documents_every_knob() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for cls in (ServerConfig, DramConfig, SsdConfig, S3Config, ClusterConfig, SecurityConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.metadata['env']}`" in readme, f.name


def test_readme_example_runs(node: NodeProcess) -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("```python\n") + len("```python\n")
    code = readme[start : readme.index("```", start)]
    code = code.replace("kvpool://127.0.0.1:7700", node.url)
    exec(compile(code, "README.md", "exec"), {})


def test_impossible_dram_capacity_is_a_clear_error() -> None:
    out = kvpool("serve", "--data-port", "0", "--admin-port", "0", "--dram-capacity", "100")
    assert out.returncode == 2 and "DRAM tier" in out.stderr, out.stderr


def test_readme_knob_table_is_current() -> None:
    from pathlib import Path

    from kvpool.server.config import knob_table

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert knob_table() in readme, "regenerate the README table from config.knob_table()"
