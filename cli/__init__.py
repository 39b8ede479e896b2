"""The ``kvpool`` command line: above every other package, imported by none of them.

It needs only the SDK's dependencies, except ``serve`` (the node: ``kvpool[server]``) and
``demo`` (torch and transformers: ``kvpool[hf]``), which say so in one line when theirs are
missing.
"""

from kvpool.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
