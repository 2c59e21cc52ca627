"""What a save knows of commits already made: the target's marker for an id, and the other tiers
(read once per process, see :mod:`tierstore.records.known`). One id, one content: an id committed
in any tier is refused unless the writer overwrites."""

from __future__ import annotations

from tierstore._platform.bounded import Prober
from tierstore.config import Config
from tierstore.errors import CheckpointExistsError
from tierstore.ids import marker_path
from tierstore.records.known import Elsewhere, elsewhere_for
from tierstore.records.marker import Manifest, read_manifest
from tierstore.records.sightings import Sighting
from tierstore.tiers import Tier


def look_elsewhere(config: Config, node: int, coordinator: bool) -> Elsewhere:
    """This process's knowledge of the tiers besides the target, read once per process at
    its first save (each tier within ``probe_timeout``; the writer keeps it): the coordinator
    looks at every tier, the other ranks at their node's node-local ones (see
    :mod:`tierstore.records.known`)."""
    tiers = config.make_tiers(node=node)
    elsewhere = elsewhere_for(tiers)
    # Every tier, the target too: a later save of this process into another tier must not
    # ask the first one's target again (it was looked at here).
    elsewhere.look(tiers if coordinator else [t for t in tiers if t.node_local], Prober(config.probe_timeout))
    return elsewhere


def refuse_committed_id(
    tier: Tier, elsewhere: Elsewhere, checkpoint_id: str, sightings: dict[str, Sighting]
) -> None:
    """An id committed in *any* tier is taken: saving it again without ``overwrite`` would let
    two different contents carry one id. The target tier is asked; the others are known from
    start-up, the promoter's sightings and this process's commits, never asked.

    Raises:
        CheckpointExistsError: naming the tier that holds the id.
    """
    holder = tier.name if tier.exists(marker_path(checkpoint_id)) else None
    holder = holder or elsewhere.holder(checkpoint_id, besides=tier.name, sightings=sightings)
    if holder is not None:
        raise CheckpointExistsError(
            f"checkpoint {checkpoint_id!r} is already committed in tier {holder}; pass"
            " overwrite=True to TieredWriter to replace it"
        )


def marker(tier: Tier, checkpoint_id: str) -> Manifest | None:
    """The id's marker in the target now; None when there is none (or none readable)."""
    try:
        return read_manifest(tier, checkpoint_id)
    except Exception:  # noqa: BLE001 - no marker, or none readable: no commit to speak of
        return None


def current_commit(tier: Tier, checkpoint_id: str) -> tuple[str, str, int | None]:
    """``(id, generation, seq)`` of the id's marker in the target ('' and None: none)."""
    found = marker(tier, checkpoint_id)
    return (checkpoint_id, "", None) if found is None else (checkpoint_id, found.generation, found.seq)


def published(tier: Tier, checkpoint_id: str, generation: str) -> Manifest | None:
    """The marker naming this save's generation, if its publish happened after all (a publish
    can fail after its rename); None: the save did not commit."""
    found = marker(tier, checkpoint_id)
    return found if found is not None and found.generation == generation else None
