"""The ``tierstore`` command (``python -m tierstore``): its commands in :mod:`.main`, the audit behind
``verify`` (:mod:`.audit`), ``status`` (:mod:`.status`) and ``advise`` (:mod:`.interval`).

Never imports torch, except ``restore``, ``drill`` and ``export`` when they run.
"""

from tierstore.cli.main import EXIT_ERROR, build_parser, main

__all__ = ["EXIT_ERROR", "build_parser", "main"]
