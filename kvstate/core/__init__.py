"""The core: records (data only), the generic operations, masks and leases,
invariants, handles and argument checks.

Imports: ``kvstate.errors`` only. Design: ``notes/core.md``.
"""
