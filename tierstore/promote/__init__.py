"""The promoter sidecar (``tierstore promote``): discovery, policy, promotion, retention, cleanup.

Never imports torch: it runs beside the trainer, in its own container or process.
"""
