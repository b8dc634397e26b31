"""The command line: the composition root that turns flags, files and environment into configs and runs."""

from streamer.cli.errors import UserError
from streamer.cli.main import build_parser, main, parse

__all__ = ["main", "build_parser", "parse", "UserError"]
