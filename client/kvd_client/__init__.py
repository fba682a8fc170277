"""kvd_client: the engine library of kvd.

The raw client (Client, AsyncClient: put_entry, lookup, ...) needs neither mlx nor mlx-lm at
import; it names entries by kvd_protocol.Identity (an identity: codec set and runtime
included). The cache layer (EngineIdentity, Restored, register_codec, ColdTier) imports them
when first named, so `import kvd_client` stays cheap for tools that only talk to the daemon.
"""

import warnings
from importlib import import_module
from typing import TYPE_CHECKING, Any

from kvd_protocol.errors import DaemonUnavailableError

from kvd_client.async_client import AsyncClient, AsyncLookupResult, AsyncTicket
from kvd_client.client import Client, LookupResult, Ticket
from kvd_client.entry_io import TensorLayoutError
from kvd_client.link import Backoff, ClientStats, DaemonError
from kvd_client.results import Evicted, TicketState

if TYPE_CHECKING:
    from kvd_client.codecs import CodecError, register_codec
    from kvd_client.identity import EngineIdentity
    from kvd_client.mlx_lm_cache import ColdTier
    from kvd_client.prompt_cache import Restored

__version__ = "0.1.0"

# Names of the cache layer, and the module each comes from (imported on first use).
_LAZY = {
    "CodecError": "kvd_client.codecs",
    "register_codec": "kvd_client.codecs",
    "EngineIdentity": "kvd_client.identity",
    "ColdTier": "kvd_client.mlx_lm_cache",
    "Restored": "kvd_client.prompt_cache",
}


# Former names, kept for engines written against them: each warns, then gives the class.
_DEPRECATED = {
    "Identity": ("kvd_client.identity", "EngineIdentity"),
    "WireIdentity": ("kvd_protocol.identity", "Identity"),
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        former, new = _DEPRECATED[name]
        warnings.warn(
            f"kvd_client.{name} is deprecated: use {former.split('.')[0]}.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(import_module(former), new)
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
    "EngineIdentity",
    "Evicted",
    "LookupResult",
    "Restored",
    "TensorLayoutError",
    "Ticket",
    "TicketState",
    "register_codec",
]
