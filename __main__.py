import sys

from onegraph.cli import main

sys.exit(main())
