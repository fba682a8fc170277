"""The `kvd` command: `kvd [serve] [flags]` runs the daemon in the foreground (it never forks)."""

from __future__ import annotations

import argparse
import os
import sys

from kvd import __version__
from kvd.config import ConfigError, add_config_arguments, load_config
from kvd.logs import configure_logging, get_logger
from kvd.serve.listener import SocketInUseError
from kvd.serve.metrics_http import MetricsPortInUseError
from kvd.serve.server import serve
from kvd.store.tier_dir import TierLockedError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd", description="The kvd daemon: a shared SSD cold tier for MLX prompt caches."
    )
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    parser.add_argument("command", nargs="?", default="serve", choices=["serve"])
    add_config_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args, os.environ)
    except ConfigError as exc:
        print(f"kvd: configuration error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_format)
    log = get_logger("kvd")
    try:
        serve(config)
    except (SocketInUseError, TierLockedError, MetricsPortInUseError, PermissionError) as exc:
        log.error("not_started", reason=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
