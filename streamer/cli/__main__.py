"""`python -m streamer.cli`: the `streamer` command."""

import sys

from streamer.__main__ import run

sys.exit(run())
