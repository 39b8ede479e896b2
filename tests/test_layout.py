"""The architecture in DESIGN.md: dependency arrows, public exports, no torch in the server."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, NodeProcess

# package -> the kvpool packages it may import (DESIGN.md "Layout"; plus server -> client:
# a node reaches its peers through the SDK, see docs/architecture.md)
ALLOWED = {
    "protocol": set(),
    "placement": {"protocol"},
    "tiers": {"protocol", "placement"},
    "server": {"protocol", "placement", "tiers", "client"},
    "client": {"protocol", "placement"},
    "gpu": {"protocol", "placement", "client"},
    # the command line sits above all of them; nothing in the library imports it
    "cli": {"protocol", "placement", "tiers", "server", "client", "gpu", "bench", "examples"},
    # the demo and the model loader: users of the library, used by nothing in it (the demo
    # runs a local node as kvpool cluster up does, through cli.local_cluster; `kvpool demo`
    # loads the demo by name, with no import edge back)
    "examples": {"protocol", "placement", "client", "gpu", "server", "cli"},
}


@pytest.mark.parametrize("package", list(ALLOWED))
def test_dependency_arrows(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("kvpool."):
                    target = name.split(".")[1]
                    assert target == package or target in ALLOWED[package], \
                        f"{path.relative_to(ROOT)} imports {name}"
                assert name.split(".")[0] not in ALLOWED, \
                    f"{path.relative_to(ROOT)} imports bare top-level {name}"


@pytest.mark.parametrize("package", list(ALLOWED))
def test_no_package_imports_another_packages_private_modules(package: str) -> None:
    """``kvpool.client._shm`` is the client's business: another package that needs
    something in it needs it moved where both may import it (host_id went to protocol).
    The benchmarks are not held to this: they measure internals on purpose."""
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "kvpool" and len(parts) > 2 and parts[1] != package:
                    assert not any(p.startswith("_") for p in parts[2:]), \
                        f"{path.relative_to(ROOT)} imports {name}"


def _module_imports() -> dict[str, set[str]]:
    """Every library module's kvpool imports, as module names: at the top, inside
    functions and under ``TYPE_CHECKING`` alike (a circle of type-only imports is still
    two modules that each need the other to be read)."""
    modules = {}
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(("kvpool", *path.relative_to(ROOT).with_suffix("").parts))
            modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for imported in targets:
                target = imported
                while target and target not in modules:  # X.name may be a module or not
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def test_no_import_circle() -> None:
    """DESIGN.md's arrows between packages, and inside each package no two modules that
    need each other: a circle is broken by naming what one reads of the other as a
    Protocol where it reads it (``ArenaHost``, ``LinkOptions``, ``InPlaceTarget``)."""
    graph = _module_imports()
    assert "kvpool.client._node" in graph["kvpool.client._async"]  # the graph is read
    done: set[str] = set()
    circles = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append([*path[path.index(module):], module])
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("package", ["protocol", "placement", "tiers", "server", "client",
                                     "cli"])
def test_exports_exist(package: str) -> None:
    module = importlib.import_module(f"kvpool.{package}")
    assert module.__all__, package
    for name in module.__all__:
        assert hasattr(module, name), f"kvpool.{package}.{name}"


def test_server_does_not_import_torch() -> None:
    code = ("import sys, kvpool.server.node, kvpool.cli.main, kvpool.client;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


SERVER_ONLY = ("aiohttp", "rocksdict", "boto3", "botocore", "lz4", "sortedcontainers", "psutil",
               "prometheus_client", "opentelemetry.sdk", "opentelemetry.exporter")


def test_pip_install_kvpool_is_the_sdk_without_the_node_dependencies() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    for name in ("aiohttp", "rocksdict", "boto3", "lz4", "psutil", "opentelemetry-sdk"):
        assert name not in base, name
        assert any(name in d for d in project["optional-dependencies"]["server"]), name


def test_the_wheel_holds_the_library_but_no_tests_or_benchmarks(tmp_path: Path) -> None:
    """What `pip install kvpool` puts on a machine: every library package (the CLI, vLLM's
    serve shim), and neither the test suite nor the benchmarks (they come with the
    source: `kvpool bench` runs a checkout's)."""
    import shutil
    import zipfile

    # a copy: setuptools builds in the tree, and a stale build/ there would ship its files
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "results", "wheels",
        "kvpool-data", "kvpool-cluster", ".venv", ".mypy-src"))
    # no build isolation: the build backend already installed here, no index asked
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("kvpool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[1] for n in names if n.startswith("kvpool/") and n.count("/") > 1}
    assert packages == set(ALLOWED)
    assert "kvpool/gpu/vllm_serve.py" in names
    assert not [n for n in names if "test" in n.split("/")[-1] or "/tests/" in n]
    assert not [n for n in names if n.split("/")[0] in ("bench", "tests") or "/bench/" in n]


def test_the_sdk_and_the_cli_run_without_the_node_dependencies(node: NodeProcess) -> None:
    """What an engine's process gets from `pip install kvpool`: the server's libraries made
    unimportable, the SDK still reads and writes, the CLI still talks to a node, and
    `kvpool serve` says in one line what to install."""
    code = f"""
import importlib.abc, os, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith({SERVER_ONLY!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
from kvpool.client import Client
with Client({node.url!r}) as c:
    c.put(bytes(16), b"sdk only")
    assert c.get(bytes(16)) == b"sdk only" and c.lookup([bytes(16)]) == 1
from kvpool.cli import main
assert main(["stats", "--admin", {node.admin_url!r}, "--json"]) == 0
assert main(["serve", "--data-port", "0"]) == 2
import runpy
sys.argv = ["python -m kvpool.server", "--data-port", "0"]  # how LocalCluster starts nodes
try:
    runpy.run_module("kvpool.server", run_name="__main__")
except SystemExit as exc:
    assert "pip install 'kvpool[server]'" in str(exc.code), exc.code
else:
    raise AssertionError("python -m kvpool.server ran without the node's dependencies")
print("loaded:", sorted(m for m in sys.modules if m.startswith({SERVER_ONLY!r})))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("loaded: []")
    assert "kvpool serve needs the node's dependencies" in done.stderr
    assert "pip install 'kvpool[server]'" in done.stderr and "Traceback" not in done.stderr
