"""The daemon's socket: the server and its sessions, the listener and socket activation
(launchd, systemd), socket I/O and descriptor hand-outs, peer credentials, and what the
daemon reports about itself (the status report, metrics and their HTTP endpoint).

Imports kvd.store and kvd's shared modules; never kvd.ops.
"""
