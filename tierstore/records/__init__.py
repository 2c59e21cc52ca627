"""The commit protocol's records and the one module that operates on them (:mod:`.protocol`).

Torch-free. What lives in a tier besides checkpoint data: the commit marker (:mod:`.marker`), the
commit log (:mod:`.log`), part records (:mod:`.parts`), activity records (:mod:`.activity`), peer-mirror
records (:mod:`.mirror`), and what the promoter saw in the other tiers (:mod:`.sightings`). The catalog
(:mod:`.catalog`) reads them to say what is committed where.
"""
