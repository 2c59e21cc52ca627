"""A model of one tier under concurrent actors, driving the commit state machine directly.

The actors — savers (with and without ``overwrite``), promotions arriving from a faster tier,
retention, cleanup, restores — each run the protocol's operations through :func:`decide` /
:func:`observe` of :mod:`tierstore.records.machine` (or of a mutant of it) against :class:`Store`, a
plain in-memory tier. Their *effects* interleave: before every effect the scheduler picks which actor
moves next, kills one (a crash at that effect boundary: it does nothing more, and its activity record
stops being refreshed), or lets time pass. Invariants are checked after every effect; at the end
every actor left is run alone to completion, then fresh actors check liveness.

Safety:

* **S1** no marker stands over a missing or short file, except while its publisher (alive) is between
  putting it and checking the files again;
* **S2** the tier's highest commit number never goes back;
* **S3** no number is won by two claims;
* **S4** no acknowledged commit is lost: once a save or promotion returned committed, the id's
  marker names its generation until a newer commit replaces it or retention retires it;
* **S5** a restore that read a marker and holds a live read record finds every file it names;
* **S6** a replacing publish swaps only the generation it judged, for a newer commit;
* **S7** commit order: a save that commits after another returned has a higher number, and every
  save commits above the floor its process knew.

Liveness (after the schedule, each actor alone): a fresh save of a new id commits; a fresh overwrite
of a committed id commits; a newer promoted copy replaces an older one; once time has passed,
cleanup leaves no generation that no marker names.
"""

from __future__ import annotations

import itertools
import random
import types
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from tierstore.errors import IntegrityError
from tierstore.ids import checkpoint_file
from tierstore.records.log import LogEntry
from tierstore.records.marker import FileEntry, Manifest

IDS = ("a", "b", "c")
PATIENCE = 8
"""Bounded asynchrony: an actor at work moves again within this many steps of the others. A pause
beyond it (SIGSTOP, a long GC pause) is what the keeper's fencing epoch answers, not this model:
retention paused between reading a marker and deleting it, across a whole overwrite, would delete
the overwrite's marker (``docs/design.md``, "Known limits")."""
TTL = 10.0
STALE = 100.0
"""Cleanup's ``stale_after``, far above the activity records' ``TTL`` (3600 s against 60 s by
default): time jumps that long only while no live actor's heartbeat lags (a save slower than
``stale_after`` with a stalled heartbeat is beyond the design)."""
FILES = 3


class Violation(AssertionError):  # noqa: N818 - an invariant's violation, not an error of the model
    """An invariant broke; the message names it and the schedule's last steps."""


@dataclass
class Store:
    """One tier: markers, the commit log, data files and activity records, on a model clock."""

    markers: dict[str, Manifest] = field(default_factory=dict)
    entries: set[tuple[int, str, str]] = field(default_factory=set)
    entry_at: dict[tuple[int, str, str], float] = field(default_factory=dict)
    voids: dict[int, bytes] = field(default_factory=dict)
    files: dict[str, tuple[int, float]] = field(default_factory=dict)
    """path -> (size, written at)."""
    activities: dict[tuple[int, str], tuple[str, str, str | None, float]] = field(default_factory=dict)
    """(actor number, kind) -> (kind, id, generation, refreshed at)."""
    clock: float = 0.0

    def highest(self) -> int:
        return max([0, *(e[0] for e in self.entries), *self.voids])


@dataclass
class Actor:
    """One running actor: its steps, its name for traces, and what it is doing."""

    number: int
    name: str
    steps: Generator[None, None, Any]
    publishing: str | None = None
    """The id whose marker it put and has not checked again yet."""
    alive: bool = True
    moved: int = 0
    """The schedule's step at its last move."""
    lagging: bool = False
    """Its heartbeat lags: its activity record ages although it works on (a slow tier, a stall)."""
    result: Any = None
    error: BaseException | None = None


@dataclass
class World:
    """The store, the actors, and what the invariants remember."""

    machine: types.ModuleType
    rng: random.Random
    store: Store = field(default_factory=Store)
    actors: list[Actor] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    counter: int = 0
    won: dict[int, int] = field(default_factory=dict)
    """number -> actor that won it."""
    high: int = 0
    committed: list[tuple[str, str, int, int, int]] = field(default_factory=list)
    """Saves that returned committed: (id, generation, seq, step renumbered, step returned)."""
    copies: list[tuple[str, str, int]] = field(default_factory=list)
    """Every promoted copy: (id, generation, seq)."""
    acked: dict[str, str] = field(default_factory=dict)
    """id -> the generation its last acknowledged commit put (S4)."""
    retiring: set[tuple[str, str]] = field(default_factory=set)
    """What retention decided to retire: a commit it retires is not lost."""
    puts: dict[str, int] = field(default_factory=dict)
    """id -> the step of the last marker put."""
    step: int = 0
    promoted: int = 1000
    """Numbers of promoted copies come from the faster tier, above the saves' own here."""

    # -- running operations -------------------------------------------------------------------

    def run(self, actor: Actor, op: Any) -> Generator[None, None, Any]:
        """Run ``op`` as ``actor``: a yield before every effect (the scheduler's turn)."""
        m = self.machine
        view, event = m.start(op, "model")
        try:
            return (yield from self._steps(actor, view, event))
        finally:
            self.store.activities.pop((actor.number, "drop"), None)  # released at the end

    def _steps(self, actor: Actor, view: Any, event: Any) -> Generator[None, None, Any]:
        m = self.machine
        while True:
            for effect in m.decide(view, event):
                if isinstance(effect, m.Done):
                    return effect.value
                if isinstance(effect, m.Fail):
                    raise effect.error
                if isinstance(effect, m.KillPoint):
                    continue
                yield
                outcome = self.perform(actor, effect)
                self.check(f"{actor.name}: {type(effect).__name__}")
                if effect.asks:
                    event = outcome
                    view = m.observe(view, event)
                    break
            else:
                raise AssertionError(f"{type(view.op).__name__}: no result, no question")

    def perform(self, actor: Actor, effect: Any) -> Any:
        m, s = self.machine, self.store
        kind = type(effect).__name__
        if kind == "ListLog":
            entries = sorted(e for e in s.entries if e[0] > effect.above)
            voids = sorted(v for v in s.voids if v > effect.above)
            return m.LogListed(tuple(LogEntry(*e) for e in entries), tuple(voids), effect.purpose)
        if kind == "PutVoid":
            if effect.seq in s.voids:
                return m.VoidPut(effect.seq, won=False)
            s.voids[effect.seq] = effect.body
            if effect.seq in self.won:
                raise Violation(f"S3: number {effect.seq} won twice")
            self.won[effect.seq] = actor.number
            return m.VoidPut(effect.seq, won=True)
        if kind == "KeepVoid":
            s.voids[effect.seq] = b""
        elif kind == "PutEntry":
            entry = (effect.seq, effect.checkpoint_id, effect.generation)
            if effect.create_only and entry in s.entries:
                raise FileExistsError(entry)
            s.entries.add(entry)
            s.entry_at[entry] = s.clock
        elif kind == "DeleteEntry":
            s.entries.discard((effect.entry.seq, effect.entry.checkpoint_id, effect.entry.generation))
        elif kind == "CheckFiles":
            problems = tuple(self.problems(effect.manifest))
            if effect.purpose == "after" and not problems:
                actor.publishing = None  # checked again: the marker is over whole files
            return m.FilesChecked(problems, effect.purpose)
        elif kind == "ReadMarker":
            held = s.markers.get(effect.checkpoint_id)
            if effect.purpose == "expect":
                actor.expect_seen = None if held is None else held.generation  # type: ignore[attr-defined]
            if held is None:
                if effect.tolerate is m.Tolerate.NOTHING:
                    raise FileNotFoundError(effect.checkpoint_id)
                return m.MarkerRead(m.NO_MARKER, effect.purpose)
            return m.MarkerRead(m.Seen(held.generation, held.seq, held), effect.purpose)
        elif kind == "PutMarker":
            return self.put_marker(actor, effect)
        elif kind == "DeleteMarker":
            self.delete_marker(actor, effect.checkpoint_id)
        elif kind in ("DeleteParts", "RemoveIfEmpty", "RaiseHead"):
            pass  # no part records, no directories, no head (a hint no decision reads) in this model
        elif kind == "ReadActivities":
            busy = self.busy(effect.checkpoint_id, effect.generation, effect.ttl, drops=effect.drops)
            return m.InUse(busy, "drops" if effect.drops else "")
        elif kind == "Announce":
            s.activities[(actor.number, effect.kind)] = (
                effect.kind,
                effect.checkpoint_id,
                effect.generation,
                s.clock,
            )
        elif kind == "DeleteData":
            prefix = f"{effect.checkpoint_id}/{effect.generation}/"
            for path in [p for p in s.files if p.startswith(prefix)]:
                del s.files[path]
        else:
            raise AssertionError(f"the model performs no {kind}")
        return None

    def problems(self, manifest: Manifest) -> list[str]:
        found = []
        for entry in manifest.files:
            path = checkpoint_file(manifest.checkpoint_id, entry.path)
            held = self.store.files.get(path)
            if held is None or held[0] != entry.size:
                found.append(f"{path}: missing or short")
        return found

    def put_marker(self, actor: Actor, effect: Any) -> Any:
        m, s = self.machine, self.store
        new: Manifest = effect.manifest
        ckpt = new.checkpoint_id
        standing = s.markers.get(ckpt)
        if standing is not None and effect.create_only:
            return m.MarkerPut(taken=True)
        expect = getattr(actor, "expect", {}).get(ckpt)
        if expect is not None and standing is not None and standing.generation != new.generation:
            seen = getattr(actor, "expect_seen", expect)
            if seen != expect:
                raise Violation(f"S6: {actor.name} swapped {ckpt} although it last read {seen}, not {expect}")
            if standing.generation == expect and (standing.seq or 0) >= (new.seq or 0):
                raise Violation(f"S6: {actor.name} put commit {new.seq} over the newer {standing.seq}")
        s.markers[ckpt] = new
        actor.publishing = ckpt
        actor.put_at = self.step  # type: ignore[attr-defined]
        self.puts[ckpt] = self.step
        if self.acked.get(ckpt, new.generation) != new.generation:
            del self.acked[ckpt]  # a newer commit replaced it
        return m.MarkerPut(taken=False)

    def delete_marker(self, actor: Actor, ckpt: str) -> None:
        if self.store.markers.pop(ckpt, None) is not None:
            actor.publishing = None

    def acknowledge(self, actor: Actor, ckpt: str, gen: str) -> None:
        """``actor`` returned its commit of ``gen``: it stands, or a later put replaced it."""
        held = self.store.markers.get(ckpt)
        if (ckpt, gen) in self.retiring:
            return  # retired before its save returned: retention's choice, not a loss
        if held is not None and held.generation == gen:
            self.acked[ckpt] = gen
        elif self.puts.get(ckpt, -1) <= getattr(actor, "put_at", -1):
            raise Violation(f"S4: {actor.name} returned its commit of {ckpt} ({gen}), which no marker names")

    def busy(self, ckpt: str, generation: str | None, ttl: float, *, drops: bool = False) -> bool:
        s = self.store
        return any(
            c == ckpt and (generation is None or g is None or g == generation) and s.clock - at < ttl
            for kind, c, g, at in s.activities.values()
            if (kind == "drop") == drops
        )

    # -- invariants -----------------------------------------------------------------------------

    def check(self, what: str) -> None:
        self.step += 1
        self.trace.append(what)
        s = self.store
        for ckpt, manifest in s.markers.items():
            publishers = [a for a in self.actors if a.alive and a.publishing == ckpt]
            if self.problems(manifest) and not publishers:
                raise Violation(f"S1: {ckpt}'s marker of {manifest.generation} stands over missing files")
        for ckpt, gen in self.acked.items():
            held = s.markers.get(ckpt)
            if held is None or held.generation != gen:
                raise Violation(
                    f"S4: {ckpt}'s acknowledged commit {gen} is lost (marker: {held and held.generation})"
                )
        if s.highest() < self.high:
            raise Violation(f"S2: the highest number went back from {self.high} to {s.highest()}")
        self.high = s.highest()
        for actor in self.actors:
            records = [r for (number, _kind), r in s.activities.items() if number == actor.number]
            if any(s.clock - r[3] >= TTL for r in records):
                actor.stale = True  # type: ignore[attr-defined]  # its record lapsed: on its own
            for ckpt, gen in getattr(actor, "reading", set()):
                prefix = f"{ckpt}/{gen}/"
                fresh = not getattr(actor, "stale", False)
                if actor.alive and fresh and sum(p.startswith(prefix) for p in s.files) < FILES:
                    raise Violation(f"S5: the files of {ckpt}/{gen} went while {actor.name} read them")

    # -- the actors -------------------------------------------------------------------------------

    def spawn(self, name: str, body: Callable[[Actor], Generator[None, None, Any]]) -> Actor:
        actor = Actor(len(self.actors) + 1, name, iter(()))  # type: ignore[arg-type]
        actor.steps = body(actor)
        self.actors.append(actor)
        return actor

    def release(self, actor: Actor) -> None:
        for key in [k for k in self.store.activities if k[0] == actor.number]:
            del self.store.activities[key]

    def hold(self, actor: Actor, kind: str, ckpt: str, gen: str | None) -> None:
        self.store.activities[(actor.number, kind)] = (kind, ckpt, gen, self.store.clock)

    def write_files(self, actor: Actor, ckpt: str, gen: str) -> Generator[None, None, tuple[FileEntry, ...]]:
        entries = []
        for i in range(FILES):
            yield
            path = f"{gen}/r{i}"
            self.store.files[checkpoint_file(ckpt, path)] = (8 + i, self.store.clock)
            entries.append(FileEntry(path, 8 + i, 0))
            self.check(f"{actor.name}: writes {ckpt}/{path}")
        return tuple(entries)

    def saver(
        self, ckpt: str, *, overwrite: bool, floor: int = 0
    ) -> Callable[[Actor], Generator[None, None, Any]]:
        def body(actor: Actor) -> Generator[None, None, Any]:
            m = self.machine
            self.counter += 1
            gen = f"g{self.counter:04d}"
            self.hold(actor, "write", ckpt, gen)
            actor.own = {(ckpt, gen)}  # type: ignore[attr-defined]
            seq = yield from self.run(actor, m.Claim(ckpt, gen, floor))
            files = yield from self.write_files(actor, ckpt, gen)
            begun = self.step
            known = max(floor, self.high_known(ckpt))
            seq = yield from self.run(actor, m.Renumber(ckpt, gen, seq, known))
            manifest = Manifest(ckpt, gen, 1, files, seq=seq, overwrite=overwrite)
            if not overwrite and ckpt in self.store.markers:  # one id, one content
                yield from self.run(actor, m.Drop(ckpt, gen, committed=False, ttl=TTL))
                return "refused"
            taken = yield from self.run(actor, m.Publish(manifest, replace=overwrite, log=False, ttl=TTL))
            if taken is not None:
                yield from self.run(actor, m.Drop(ckpt, gen, committed=False, ttl=TTL))
                return "refused"
            if seq <= known:
                raise Violation(f"S7: {actor.name} committed {seq}, not above {known}, known elsewhere")
            self.committed.append((ckpt, gen, seq, begun, self.step))
            self.acknowledge(actor, ckpt, gen)
            self.release(actor)
            return "committed"

        return body

    def high_known(self, ckpt: str) -> int:
        """What a process knows beyond this tier: the faster tier's numbers (its promotions)."""
        return self.promoted if self.rng.random() < 0.5 else 0

    def promotion(
        self, ckpt: str, *, newest: bool = False, again: bool = False
    ) -> Callable[[Actor], Generator[None, None, Any]]:
        """A copy committed in a faster tier arrives (``newest``: numbered above all this tier holds;
        ``again``: a generation promoted before, as a restarted or second promoter copies it)."""

        def body(actor: Actor) -> Generator[None, None, Any]:
            m = self.machine
            self.counter += 1
            earlier = [c for c in self.copies if c[0] == ckpt]
            marker = self.store.markers.get(ckpt)
            left = [c for c in earlier if any(p.startswith(f"{ckpt}/{c[1]}/") for p in self.store.files)]
            left = [c for c in left if marker is None or marker.generation != c[1]]  # a killed one's
            if again and earlier:
                _, gen, seq = self.rng.choice(left or earlier)
            else:
                self.promoted = max(self.promoted, self.store.highest() if newest else 0) + 1
                gen, seq = f"p{self.counter:04d}", self.promoted
                self.copies.append((ckpt, gen, seq))
            self.hold(actor, "promote", ckpt, gen)
            actor.expect = {}  # type: ignore[attr-defined]
            files = yield from self.write_files(actor, ckpt, gen)
            source = Manifest(ckpt, gen, 1, files, seq=seq, overwrite=True)
            existing = yield from self.run(actor, m.Publish(source, replace=False, log=True, ttl=TTL))
            for _attempt in range(8):
                if existing is None:
                    self.acknowledge(actor, ckpt, gen)
                    return "published"
                verdict, _why = m.judge_promotion(source, existing, source_tier="fast", target="model")
                if verdict is not m.Verdict.REPLACE:
                    return verdict.name
                actor.expect[ckpt] = existing.generation  # type: ignore[attr-defined]
                try:
                    publish = m.Publish(source, replace=True, log=True, ttl=TTL, expect=existing.generation)
                    existing = yield from self.run(actor, publish)
                except FileNotFoundError:
                    existing = yield from self.run(actor, m.Publish(source, replace=False, log=True, ttl=TTL))
            return "gave up"

        return body

    def retention(self, ckpt: str) -> Callable[[Actor], Generator[None, None, Any]]:
        def body(actor: Actor) -> Generator[None, None, Any]:
            m = self.machine
            yield
            held = self.store.markers.get(ckpt)
            newest = max(self.store.markers.values(), key=lambda x: x.seq or 0, default=None)
            if held is None or newest is None or newest.checkpoint_id == ckpt:
                return "kept"  # never the tier's newest
            if self.busy(ckpt, None, TTL):
                return "in use"  # a save, promotion or restore of the id is at work (retain.planned)
            self.retiring.add((ckpt, held.generation))
            if self.acked.get(ckpt) == held.generation:
                del self.acked[ckpt]  # retired, as retention decided
            return (yield from self.run(actor, m.Drop(ckpt, held.generation, committed=True, ttl=TTL)))

        return body

    def cleanup(self) -> Callable[[Actor], Generator[None, None, Any]]:
        def body(actor: Actor) -> Generator[None, None, Any]:
            m = self.machine
            yield
            s = self.store
            removed = 0
            for ckpt, gen in sorted({tuple(p.split("/")[:2]) for p in s.files}):
                marker = s.markers.get(ckpt)
                idle = all(
                    s.clock - at >= STALE for p, (_, at) in s.files.items() if p.startswith(f"{ckpt}/{gen}/")
                )
                if (marker is None or marker.generation != gen) and idle and not self.busy(ckpt, gen, TTL):
                    removed += yield from self.run(actor, m.Drop(ckpt, gen, committed=False, ttl=TTL))
            top = s.highest()
            for seq, ckpt, gen in sorted(s.entries):
                marker = s.markers.get(ckpt)
                idle = s.clock - s.entry_at.get((seq, ckpt, gen), 0.0) >= STALE
                if (marker is None or marker.generation != gen) and idle and not self.busy(ckpt, gen, TTL):
                    yield from self.run(actor, m.Forget(LogEntry(seq, ckpt, gen), top))
            return removed

        return body

    def reader(self, ckpt: str) -> Callable[[Actor], Generator[None, None, Any]]:
        def body(actor: Actor) -> Generator[None, None, Any]:
            self.hold(actor, "read", ckpt, None)  # announced before it looks, as a restore does
            yield
            held = self.store.markers.get(ckpt)
            if held is None or self.problems(held):
                return "nothing to read"
            actor.reading = {(ckpt, held.generation)}  # type: ignore[attr-defined]
            for _ in range(self.rng.randint(3, 12)):
                yield
                self.check(f"{actor.name}: reads {ckpt}/{held.generation}")
            actor.reading = set()  # type: ignore[attr-defined]
            return "read"

        return body

    def spawn_random(self, now: int) -> None:
        """A new actor of a random kind on a random id."""
        rng, ckpt = self.rng, self.rng.choice(IDS)
        beyond = self.store.highest() + rng.randint(1, 30)  # a number known beyond this tier
        makers: list[tuple[str, Callable[[], Callable[[Actor], Generator[None, None, Any]]]]] = [
            ("save", lambda: self.saver(ckpt, overwrite=False, floor=rng.choice([0, beyond]))),
            ("overwrite", lambda: self.saver(ckpt, overwrite=True)),
            ("promotion", lambda: self.promotion(ckpt)),
            ("promotion again", lambda: self.promotion(ckpt, again=True)),
            ("retention", lambda: self.retention(ckpt)),
            ("cleanup", self.cleanup),
            ("restore", lambda: self.reader(ckpt)),
        ]
        role, maker = rng.choice(makers)
        self.spawn(f"{role}#{len(self.actors) + 1}({ckpt})", maker()).moved = now

    # -- the schedule -----------------------------------------------------------------------------

    def advance(self, actor: Actor) -> None:
        try:
            next(actor.steps)
        except StopIteration as stop:
            actor.alive, actor.result = False, stop.value
            self.release(actor)
        except Violation:
            raise
        except (IntegrityError, FileNotFoundError, FileExistsError, RuntimeError) as exc:
            actor.alive, actor.error = False, exc
            self.release(actor)

    def refresh(self) -> None:
        """Live actors' activity records are refreshed (their heartbeat) unless it lags; a dead one's
        age."""
        for actor in self.actors:
            if self.rng.random() < 0.03:
                actor.lagging = not actor.lagging and self.rng.random() < 0.5
            if actor.alive and not actor.lagging:
                for key, (kind, ckpt, gen, _at) in list(self.store.activities.items()):
                    if key[0] == actor.number:
                        self.store.activities[key] = (kind, ckpt, gen, self.store.clock)

    def kill(self, actor: Actor) -> None:
        actor.alive = False
        actor.publishing = None
        actor.reading = set()  # type: ignore[attr-defined]
        self.trace.append(f"{actor.name}: killed")

    def finish(self, actor: Actor) -> Any:
        while actor.alive:
            self.advance(actor)
        if actor.error is not None and not isinstance(actor.error, IntegrityError):
            raise actor.error
        return actor.result


def schedule(world: World, steps: int) -> None:
    """Random actors, effects interleaved, kills and time; then the survivors alone."""
    rng = world.rng
    for now in range(steps):
        running = [a for a in world.actors if a.alive]
        late = [a for a in running if now - a.moved > PATIENCE]
        roll = rng.random()
        if late:
            late[0].moved = now
            world.advance(late[0])
            world.refresh()
            continue
        if roll < 0.12 or not running:
            world.spawn_random(now)
        elif roll < 0.15:
            world.kill(rng.choice(running))
        elif roll < 0.18:
            lagging = any(a.alive and a.lagging for a in world.actors)
            world.store.clock += rng.choice([1.0, TTL] if lagging else [1.0, TTL, STALE])
            world.trace.append(f"time {world.store.clock}")
        else:
            actor = rng.choice(running)
            actor.moved = now
            world.advance(actor)
        world.refresh()
    while running := [a for a in world.actors if a.alive]:  # the rest, in turns
        for actor in running:
            world.advance(actor)
            world.refresh()


def liveness(world: World) -> None:
    """Fresh actors, each alone on the quiet tier, do what they exist for."""
    fresh = world.spawn("fresh save", world.saver("fresh", overwrite=False))
    if world.finish(fresh) != "committed":
        raise Violation(f"liveness: a save of a new id did not commit ({fresh.result}, {fresh.error})")
    over = world.spawn("fresh overwrite", world.saver("fresh", overwrite=True))
    if world.finish(over) != "committed":
        raise Violation(
            f"liveness: an overwrite of a committed id did not commit ({over.result}, {over.error})"
        )
    newer = world.spawn("newer promotion", world.promotion("fresh", newest=True))
    if world.finish(newer) not in ("published", "SAME"):
        raise Violation(f"liveness: a newer promoted copy did not replace the older ({newer.result})")
    world.store.clock += STALE + TTL
    world.finish(world.spawn("late cleanup", world.cleanup()))
    for path in world.store.files:
        ckpt, gen = path.split("/")[:2]
        held = world.store.markers.get(ckpt)
        if held is None or held.generation != gen:
            raise Violation(f"liveness: cleanup left {path}, which no marker names")
    # S7: a save that began committing after another returned committed ranks newer.
    for a in world.committed:
        for b in world.committed:
            if a[4] < b[3] and a[2] >= b[2]:
                raise Violation(
                    f"S7: {b[1]} committed after {a[1]} returned but ranks older ({b[2]} <= {a[2]})"
                )


def leftover_race(world: World) -> None:
    """A focused start: a promotion killed before its marker left its files; long after, cleanup
    removes them while a second promoter copies that very generation again and a newer copy of the
    id arrives. Only the protocol's checks of the files around the marker keep the re-promotion
    from committing over the files cleanup removes."""
    first = world.spawn("promotion#0(a)", world.promotion("a"))
    for _ in range(FILES + 1):
        world.advance(first)  # its files written, nothing published
    world.kill(first)
    world.store.clock += STALE + TTL
    world.refresh()
    rng = world.rng
    cleanup = world.spawn("cleanup#1", world.cleanup())
    for _ in range(rng.randint(1, 6)):  # cleanup has chosen the generation, and is at work on it
        world.advance(cleanup)
    actors = [
        cleanup,
        world.spawn("promotion again#2(a)", world.promotion("a", again=True)),
        world.spawn("promotion#3(a)", world.promotion("a")),
    ]
    bursts(world, actors)


def retire_race(world: World) -> None:
    """A focused start: retention has chosen an old commit of ``a`` to retire when an overwrite
    of ``a`` begins (and promotions of ``a`` arrive). A marker's read and delete are not atomic:
    only the retirement giving way to a newer number of the id keeps it off the new marker."""
    for ckpt in ("a", "b"):
        world.finish(world.spawn(f"save({ckpt})", world.saver(ckpt, overwrite=False)))
    retention = world.spawn("retention#1(a)", world.retention("a"))
    world.advance(retention)  # planned: a is not the newest, and nothing is at work on it
    actors = [
        retention,
        world.spawn("overwrite#2(a)", world.saver("a", overwrite=True)),
        world.spawn("promotion#3(a)", world.promotion("a", newest=True)),
    ]
    bursts(world, actors)


def bursts(world: World, actors: list[Actor]) -> None:
    """Run ``actors`` to their ends, in bursts: now one is fast and the others slow, now another."""
    rng = world.rng
    speed: dict[int, float] = {}
    for step in itertools.count():
        if not (running := [a for a in actors if a.alive]):
            break
        if step % 3 == 0:
            speed = {a.number: rng.random() ** 3 + 0.01 for a in actors}
        late = [a for a in running if step - a.moved > PATIENCE]  # bounded asynchrony, as above
        actor = late[0] if late else rng.choices(running, [speed[a.number] for a in running])[0]
        actor.moved = step
        world.advance(actor)
        world.refresh()


def explore(machine: types.ModuleType, *, examples: int, seed: int = 0, steps: int = 120) -> None:
    """Run ``examples`` random schedules against ``machine`` (two in three from a focused start:
    :func:`leftover_race`, :func:`retire_race`); raise :class:`Violation` with the seed and the
    schedule's last steps at the first broken invariant."""
    for example in range(examples):
        world = World(machine, random.Random(seed * 1_000_003 + example))  # noqa: S311 - a schedule
        try:
            if example % 3 == 1:
                leftover_race(world)
            elif example % 3 == 2:
                retire_race(world)
            schedule(world, steps)
            liveness(world)
        except Violation as broken:
            tail = "\n  ".join(world.trace[-40:])
            raise Violation(f"{broken} (example {example}, seed {seed})\n  {tail}") from None


def mutated(machine: types.ModuleType, old: str, new: str) -> types.ModuleType:
    """A copy of the machine module whose source has ``old`` replaced by ``new`` (once, exactly)."""
    import inspect

    source = inspect.getsource(machine)
    if source.count(old) != 1:
        raise ValueError(f"the mutant's text is found {source.count(old)} times: {old!r}")
    module = types.ModuleType(f"{machine.__name__}_mutant")
    module.__dict__["__name__"] = module.__name__
    import sys

    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(source.replace(old, new), machine.__file__ or "", "exec"), module.__dict__)  # noqa: S102
    finally:
        del sys.modules[module.__name__]
    return module


def iter_records(world: World) -> Iterator[str]:
    """Every marker and entry, for debugging a failing schedule."""
    for ckpt, manifest in sorted(world.store.markers.items()):
        yield f"marker {ckpt}: {manifest.generation} #{manifest.seq}"
    for entry in sorted(world.store.entries):
        yield f"entry {entry}"


__all__ = ["Violation", "World", "explore", "mutated", "replace"]
