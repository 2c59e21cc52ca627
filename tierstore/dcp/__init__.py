"""The DCP face: ``TieredWriter``, ``TieredReader``, staging, data layout, restore choice, gates.

The only subpackage that imports torch. Import its modules directly (``tierstore.dcp.writer``) or use
the names re-exported by :mod:`tierstore`.
"""
