"""`python -m streamer` and the `streamer` command (run)."""

import sys


def run() -> int:
    """The command's main(), with a Ctrl-C that lands while its modules load (the first half second)
    or before main() takes interrupts over ending it as one afterwards does: `streamer: interrupted`,
    status 130, not a traceback."""
    try:
        from streamer.cli.main import main

        return main()
    except KeyboardInterrupt:
        print("streamer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(run())
