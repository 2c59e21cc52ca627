"""Private plumbing under every wing: the per-process runtime and its one fork hook
(:mod:`.runtime`), descriptors kept from forked children (:mod:`.forks`), file mappings
(:mod:`.mapping`), deadlines (:mod:`.bounded`), owners of staging directories (:mod:`.owners`),
kill points (:mod:`.killpoints`), progress bars (:mod:`.progress`) and the ranks' metric files
(:mod:`.save_metrics`). Nothing here imports another wing of the package.
"""

# Imported first whatever is imported from here: the runtime registers the package's one fork hook.
from tierstore._platform import runtime as runtime
