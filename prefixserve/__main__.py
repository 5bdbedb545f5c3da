"""`python -m prefixserve ...` runs the `prefixserve` command."""
import sys

from prefixserve.entrypoints.cli import main

sys.exit(main())
