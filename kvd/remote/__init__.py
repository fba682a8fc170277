"""The remote tier: the tier's blocks in an S3-compatible object store that several daemons
share. Uploads go write-behind from durable local entries; a lookup that the bucket can extend
fetches the blocks into the local tier (checked as any put is) and is answered from there.
The bucket's health gates both: down, the daemon is local-only.

Imports kvd.store and kvd's shared modules; never kvd.serve, kvd.ops.
"""
