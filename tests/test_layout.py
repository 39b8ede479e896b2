"""The architecture in DESIGN.md: dependency arrows, public exports, no torch in the server."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the kvpool packages it may import (DESIGN.md "Layout"; plus server -> client:
# a node reaches its peers through the SDK, see docs/architecture.md)
ALLOWED = {
    "protocol": set(),
    "placement": {"protocol"},
    "tiers": {"protocol", "placement"},
    "server": {"protocol", "placement", "tiers", "client"},
    "client": {"protocol", "placement"},
    "gpu": {"protocol", "placement", "client"},
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


@pytest.mark.parametrize("package", ["protocol", "placement", "tiers", "server", "client"])
def test_exports_exist(package: str) -> None:
    module = importlib.import_module(f"kvpool.{package}")
    assert module.__all__, package
    for name in module.__all__:
        assert hasattr(module, name), f"kvpool.{package}.{name}"


def test_server_does_not_import_torch() -> None:
    code = ("import sys, kvpool.server.node, kvpool.server.cli, kvpool.client;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
