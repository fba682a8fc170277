"""The tier on disk: entries and blocks, the catalog and prefix index, puts from begin to
durable, the write-behind writer, leases, eviction and admission policies, recovery,
snapshots, the watcher and the deleter. Tier (tier.py) wires them; the rest of the daemon
calls its services (puts, reads, admin, life, view, tickets, notices), never a room.

Imports kvd's shared modules only (kvd.config, kvd.logs, ...); never kvd.serve, kvd.ops.
"""
