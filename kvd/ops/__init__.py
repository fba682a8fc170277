"""The operator's tools: kvctl and its tables, and installing kvd as a service.

Imports kvd.serve, kvd.store and kvd's shared modules; no other part imports it.
"""
