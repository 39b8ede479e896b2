import sys

from kvpool.server.cli import main

sys.exit(main())
