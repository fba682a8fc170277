"""kvd: the daemon that keeps MLX prompt caches on the SSD, and kvctl, its command line."""

__version__ = "0.1.0"
