"""The `kvd` command: runs the daemon in the foreground."""

from __future__ import annotations

import sys

from kvd import __version__


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-V", "--version"):
        print(f"kvd {__version__}")
        return 0
    print(
        f"kvd {__version__}: the daemon's server is not built yet; "
        "this entry point only confirms the installation.",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
