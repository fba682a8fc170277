"""The tier on disk: entries and blocks, the catalog and prefix index, puts from begin to
durable, the write-behind writer, leases, eviction and admission policies, recovery,
snapshots, the watcher and the deleter, behind one façade, Tier (tier.py).

Imports kvd's shared modules only (kvd.config, kvd.logs, ...); never kvd.serve, kvd.ops.
"""
