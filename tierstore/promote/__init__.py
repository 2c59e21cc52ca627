"""The promoter sidecar (``tierstore promote``): a loop over one view of the tiers per pass
(``sidecar``, ``view``) and small duties over it (``duties/``), with discovery, policy, promotion,
retention and cleanup below them.

Never imports torch: it runs beside the trainer, in its own container or process.
"""
