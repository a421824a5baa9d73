"""`python -m csd_engine ...` is the `csd-engine` command."""
import sys

from csd_engine.cli import main

sys.exit(main())
