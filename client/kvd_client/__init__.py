"""kvd_client: the engine library of kvd."""

from kvd_client.async_client import AsyncClient, AsyncLookupResult, AsyncTicket
from kvd_client.calls import (
    Backoff,
    ClientStats,
    DaemonError,
    DaemonUnavailable,
    Evicted,
    TicketState,
)
from kvd_client.client import Client, LookupResult, Ticket
from kvd_client.entry_io import TensorLayoutError

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncLookupResult",
    "AsyncTicket",
    "Backoff",
    "Client",
    "ClientStats",
    "DaemonError",
    "DaemonUnavailable",
    "Evicted",
    "LookupResult",
    "TensorLayoutError",
    "Ticket",
    "TicketState",
]
