"""The mutation kit: small ordering bugs in the commit state machine that the model must catch.

Each mutant replaces one exact piece of :mod:`tierstore.records.machine`'s source. ``make soak`` runs
every mutant against the model with many examples, ``make test`` with a few; a mutant the model does
not kill fails the run (the model has a blind spot). When the machine's code changes, a mutant whose
text no longer matches fails loudly too: rewrite it against the new code, never drop it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    old: str
    new: str


MUTANTS = [
    Mutant(
        "drop: no drop record announced before it asks (a promotion of the generation misses it)",
        "        return [announce, ReadMarker(op.checkpoint_id",
        "        return [ReadMarker(op.checkpoint_id",
    ),
    Mutant(
        "publish: a promotion does not ask for a drop of its generation",
        "    if isinstance(event, Start) and op.log:",
        "    if False:",
    ),
    Mutant(
        "drop: the data before the marker is withdrawn",
        "effects: list[Effect] = [DeleteMarker(ckpt)] if event.marker.generation == gen else []",
        "effects: list[Effect] = [DeleteData(ckpt, gen), *([DeleteMarker(ckpt)] if event.marker.generation == gen else [])]",  # noqa: E501
    ),
    Mutant(
        "drop: live activity records ignored",
        'if view.busy or event.marker.generation in (gen, ""):',
        'if event.marker.generation in (gen, ""):',
    ),
    Mutant(
        "drop: the marker not asked again before the data",
        'if view.busy or event.marker.generation in (gen, ""):',
        "if view.busy:",
    ),
    Mutant(
        "claim: a taken number counted as won",
        "    if event.won:\n        return [PutEntry(event.seq",
        "    if True:\n        return [PutEntry(event.seq",
    ),
    Mutant(
        "claim: the tier's highest number taken again",
        "        return [PutVoid(view.top + 1, body)]",
        "        return [PutVoid(view.top, body)]",
    ),
    Mutant(
        "renumber: a higher number known elsewhere ignored",
        "if view.top > op.claimed or op.known >= op.claimed:",
        "if view.top > op.claimed:",
    ),
    Mutant(
        "renumber: a number taken meanwhile in the tier ignored",
        "if view.top > op.claimed or op.known >= op.claimed:",
        "if op.known >= op.claimed:",
    ),
    Mutant(
        "publish: the swap not judged against the marker read last",
        "        if event.marker.generation == op.expect:\n            return _put_marker(op)",
        "        if True:\n            return _put_marker(op)",
    ),
    Mutant(
        "judge: an older promoted copy replaces a newer one",
        "if is_newer_commit(source.seq, source.generation, existing.seq, existing.generation):",
        "if not is_newer_commit(source.seq, source.generation, existing.seq, existing.generation):",
    ),
    Mutant(
        "publish: every overwrite refused",
        "PutMarker(op.manifest, create_only=not op.replace)",
        "PutMarker(op.manifest, create_only=True)",
    ),
    Mutant(
        "forget: the highest number not kept as a void",
        "effects += [KeepVoid(entry.seq)] if entry.seq >= top else []",
        "effects += []",
    ),
    Mutant(
        "drop: a retirement does not give way to a newer commit of the id on its way",
        "        if newer:\n            return [Done(False)]",
        "        if False:\n            return [Done(False)]",
    ),
]
