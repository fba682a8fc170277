"""kvd_client: the engine library of kvd."""

__version__ = "0.1.0"
