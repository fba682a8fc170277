"""The `kvd` command and `python -m kvd`: the daemon (kvd.cli), started without the collector.

Its imports and its start-up make long-lived objects only (modules, classes, then the index):
the cyclic collector would walk them over and over and free next to nothing (~50 ms of CPU of
the imports alone). LifeCycle.open freezes what start-up made and turns the collector back on.
"""

import gc
import sys


def run() -> int:
    gc.disable()
    from kvd.cli import main  # noqa: PLC0415 - after the collector is off

    return main()


if __name__ == "__main__":
    sys.exit(run())
