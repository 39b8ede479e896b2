import sys

from kvpool.cli.main import main

sys.exit(main())
