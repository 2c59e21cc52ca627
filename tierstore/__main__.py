"""``python -m tierstore``: the ``tierstore`` command."""

import sys

from tierstore.cli.main import main

sys.exit(main())
