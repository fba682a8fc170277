"""kvd_client: the engine library of kvd.

The raw client (Client, AsyncClient: put_entry, lookup, ...) needs neither mlx nor mlx-lm at
import; it names entries by WireIdentity (the protocol's: codec set and runtime included).
The cache layer (Identity, Restored, register_codec, ColdTier) imports them when first
named, so `import kvd_client` stays cheap for tools that only talk to the daemon.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from kvd_protocol.identity import Identity as WireIdentity

from kvd_client.async_client import AsyncClient, AsyncLookupResult, AsyncTicket
from kvd_client.client import Client, LookupResult, Ticket
from kvd_client.entry_io import TensorLayoutError
from kvd_client.link import Backoff, ClientStats, DaemonError, DaemonUnavailableError
from kvd_client.results import Evicted, TicketState

if TYPE_CHECKING:
    from kvd_client.codecs import CodecError, register_codec
    from kvd_client.identity import Identity
    from kvd_client.mlx_lm_cache import ColdTier
    from kvd_client.prompt_cache import Restored

__version__ = "0.1.0"

# Names of the cache layer, and the module each comes from (imported on first use).
_LAZY = {
    "CodecError": "kvd_client.codecs",
    "register_codec": "kvd_client.codecs",
    "Identity": "kvd_client.identity",
    "ColdTier": "kvd_client.mlx_lm_cache",
    "Restored": "kvd_client.prompt_cache",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvd_client' has no attribute {name!r}")
    return getattr(import_module(module), name)


__all__ = [
    "AsyncClient",
    "AsyncLookupResult",
    "AsyncTicket",
    "Backoff",
    "Client",
    "ClientStats",
    "CodecError",
    "ColdTier",
    "DaemonError",
    "DaemonUnavailableError",
    "Evicted",
    "Identity",
    "LookupResult",
    "Restored",
    "TensorLayoutError",
    "Ticket",
    "TicketState",
    "WireIdentity",
    "register_codec",
]
