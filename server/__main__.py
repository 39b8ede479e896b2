"""``python -m kvpool.server [serve] [flags]``: run one node, as ``kvpool serve`` does.

How the library's own tools start node processes (``LocalCluster``, the benchmarks, the
demo) without going through the command line package.
"""

import argparse
import sys

from kvpool.protocol.errors import ConfigError
from kvpool.server.config import add_arguments, load_config

try:
    from kvpool.server.run import run_node
except ModuleNotFoundError as exc:  # the SDK-only install
    sys.exit(f"kvpool: a node needs its dependencies ({exc.name} is missing): "
             "pip install 'kvpool[server]'")

argv = sys.argv[1:]
if argv[:1] == ["serve"]:
    argv = argv[1:]
parser = argparse.ArgumentParser(prog="python -m kvpool.server", description="Run one node.",
                                 allow_abbrev=False)
add_arguments(parser)
try:
    run_node(load_config(parser.parse_args(argv)))
except ConfigError as exc:
    print(f"kvpool: configuration error: {exc}", file=sys.stderr)
    sys.exit(2)
