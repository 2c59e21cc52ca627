"""Corruption in every tier is detected before DCP reads the data (issue 24, item 5).

A memory → local → s3 configuration holds two checkpoints in every tier (the promoter copied them);
the newest was saved twice (an overwrite), so a marker of a replaced generation exists. Each case
damages one tier's copy of the newest checkpoint one way (:data:`tests.integrity.corruption.KINDS`)
and checks the oracle of issue 24:

(a) a restore of the full configuration yields the last committed checkpoint bit-exact from a tier
    holding a good copy; a restore that looks at the damaged tier first falls back to the next one,
    with a warning naming the tier and the damage (the file, or the marker); where the damaged
    copy is the only one, the load fails naming the tier and the damage, and loads nothing;
(b) ``tierstore verify ID`` exits 1 and names the tier and the file (a deleted marker leaves no
    copy to verify: the data left is what a save or a retention in progress leaves too);
(c) ``ls`` (:meth:`Catalog.listings`) never lists a copy whose marker is missing or unreadable,
    and ``latest_committed`` still answers the newest checkpoint.

A second set-up damages the newest copy in a tier before the promoter has copied it further, runs a
promoter pass, and checks (d): no slower tier receives a damaged copy, the pass reports the damage
(naming tier and file) and still promotes the undamaged checkpoint.

The configuration verifies CRC32C on load (``verify_on_load: true``): without it a flipped bit in a
data file of the chosen tier is not seen by a load (DCP stores no checksums); ``verify`` and every
promotion see it anyway (tests/guarantees/test_failures.py). Each case's seed is fixed (derived from
its name) and printed. The quick lane runs a few cases; ``test_detected_every_injected_fault``
(``make test``) runs them all and prints the figure for docs/operations.md.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch.distributed.checkpoint as dcp
import yaml

from tests.integrity.corruption import KINDS, Foreign, Injected, Snapshot, inject
from tests.training import Trainer, assert_same, fresh_target
from tierstore import Catalog, TieredReader, TieredWriter, latest_committed
from tierstore.cli import main
from tierstore.config import Config, config_from_dict
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import Manifest, copy_problems, read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

ID, OLDER = "step_000002", "step_000001"
TIERS = ("memory", "local", "s3")
SOURCES = ("memory", "local")
"""The tiers a copy is promoted from."""
UNREADABLE_MARKER = (
    "delete-marker",
    "malformed-marker",
    "empty-marker",
    "marker-other-id",
    "marker-other-run",
)
"""Kinds after which the damaged tier holds no marker of the id that it may read: not a copy."""
QUICK = [("memory", "marker-other-run"), ("local", "flip-data"), ("s3", "empty-marker")]
QUICK_PROMOTION = [("memory", "flip-data")]
"""The cases the quick lane runs (each names a bug this matrix found, or a kind only CRC32C sees)."""


def seed_of(*names: str) -> int:
    """A case's seed: fixed per case, so a failure repeats; printed with the case."""
    return zlib.crc32("/".join(names).encode())


@dataclass
class World:
    """One set-up that many cases share: the tiers, what was saved, a snapshot to go back to."""

    specs: list[dict[str, Any]]
    config_file: Path
    expected: dict[str, Any]
    """The state saved last under :data:`ID`."""
    generation: str
    """The generation of :data:`ID` that is committed (the overwrite's)."""
    foreign: Foreign
    snapshot: Snapshot

    def config(self, first: str = "memory") -> Config:
        """The configuration of the tiers from ``first`` down (a restore that looks there first)."""
        start = next(i for i, spec in enumerate(self.specs) if spec["name"] == first)
        return config_from_dict({"namespace": "run", "verify_on_load": True, "tiers": self.specs[start:]})

    def tier(self, name: str) -> Tier:
        return next(t for t in self.config().make_tiers(node=0) if t.name == name)


def _save(config: Config, checkpoint_id: str, seed: int, **writer: Any) -> dict[str, Any]:
    trainer = Trainer(seed)
    trainer.train(1)
    state = trainer.state()
    saved = copy.deepcopy(state)
    dcp.save(state, storage_writer=TieredWriter(config, **writer), checkpoint_id=checkpoint_id)
    return saved


def _foreign_marker(root: Path) -> bytes:
    """The marker of :data:`ID` as another run (namespace ``other``) committed it in a memory tier
    under ``root``, after more saves than this run made: its commit number is higher than this
    run's. A marker names no root: every set-up hands its tiers the same one."""
    other = config_from_dict(
        {"namespace": "other", "tiers": [{"name": "memory", "type": "memory", "path": f"{root}/{{node}}"}]}
    )
    for number in range(3):
        _save(other, f"other_{number}", seed=number)
    _save(other, ID, seed=9)
    return other.make_tiers(node=0)[0].read_bytes(marker_path(ID))


def _build_world(root: Path, endpoint: str, other_run: bytes, *, into: str | None) -> World:
    """Both checkpoints committed in every tier (``into`` None: saved, then promoted), or only in
    the tier ``into`` (saved there, not promoted)."""
    bucket = f"ts-corrupt-{zlib.crc32(str(root).encode()):08x}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    specs = [
        {"name": "memory", "type": "memory", "path": f"{root}/memory/{{node}}"},
        {"name": "local", "type": "local", "path": f"{root}/local/{{node}}"},
        {
            "name": "s3",
            "type": "s3",
            "url": f"s3://{bucket}/ckpt",
            "endpoint_url": endpoint,
            "max_attempts": 3,
        },
    ]
    top = {"namespace": "run", "verify_on_load": True}
    config_file = root / "tierstore.yaml"
    config_file.write_text(yaml.safe_dump({**top, "tiers": specs}))
    config = config_from_dict({**top, "tiers": specs})
    _save(config, OLDER, seed=1, tier=into)
    _save(config, ID, seed=2, tier=into)
    saved_in = next(t for t in config.make_tiers(node=0) if t.name == (into or "memory"))
    replaced = saved_in.read_bytes(marker_path(ID))
    expected = _save(config, ID, seed=3, tier=into, overwrite=True)
    if into is None:
        assert Promoter(config).run(once=True) == 0
    foreign = Foreign(other_run, replaced, OLDER)
    generation = read_manifest(saved_in, ID, trust=MarkerTrust()).generation
    world = World(specs, config_file, expected, generation, foreign, Snapshot([]))
    world.snapshot = Snapshot([world.tier(name) for name in TIERS])
    return world


@pytest.fixture(scope="module")
def other_run(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """:func:`_foreign_marker`, made once for every set-up."""
    return _foreign_marker(tmp_path_factory.mktemp("other-run"))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str, other_run: bytes) -> World:
    """Both checkpoints committed in every tier."""
    return _build_world(tmp_path_factory.mktemp("corruption"), s3_endpoint, other_run, into=None)


class Unpromoted(dict[str, World]):
    """For each tier a copy is promoted from: both checkpoints committed there only (each set up
    when first asked for)."""

    def __init__(self, factory: pytest.TempPathFactory, endpoint: str, other_run: bytes) -> None:
        super().__init__()
        self.factory, self.endpoint, self.other_run = factory, endpoint, other_run

    def __missing__(self, name: str) -> World:
        root = self.factory.mktemp(f"unpromoted-{name}")
        self[name] = _build_world(root, self.endpoint, self.other_run, into=name)
        return self[name]


@pytest.fixture(scope="module")
def unpromoted(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str, other_run: bytes) -> Unpromoted:
    return Unpromoted(tmp_path_factory, s3_endpoint, other_run)


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The WARNING (and worse) lines tierstore logs inside the block."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("tierstore")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def _load(config: Config) -> tuple[dict[str, Any], TieredReader]:
    """Load :data:`ID` into a differently initialised trainer: its state, and the reader."""
    target, state = fresh_target()
    reader = TieredReader(config)
    dcp.load(state, storage_reader=reader, checkpoint_id=ID)
    target.restore(state)
    return target.state(), reader


def _names_the_damage(text: str, injected: Injected, world: World) -> bool:
    """Whether ``text`` names what was damaged: the file; for a deleted marker, that there is none;
    for a marker of a replaced generation, that generation (the marker is well-formed: what is
    wrong with it is that a newer commit of the id exists)."""
    if injected.kind == "delete-marker":
        return "no commit marker" in text
    if injected.kind == "marker-other-generation":  # verify names the files that marker names
        return Manifest.from_json(world.foreign.other_generation, where="").generation in text
    return injected.path in text


def check_restore(world: World, injected: Injected) -> None:
    """(a): the restores."""
    state, reader = _load(world.config())
    assert_same(world.expected, state, f"{injected}: full configuration")
    assert reader.chosen_tier != injected.tier, f"{injected}: the damaged copy was served"
    first = world.config(first=injected.tier)
    names = [t.name for t in first.tiers]
    if len(names) > 1:
        with _warnings() as warned:
            state, reader = _load(first)
        assert_same(world.expected, state, f"{injected}: restore from {names}")
        assert reader.chosen_tier == names[1], f"{injected}: fell back to {reader.chosen_tier}"
        said = " | ".join(warned)
        assert f"skipping tier {injected.tier}" in said, f"{injected}: no warning: {said}"
        assert _names_the_damage(said, injected, world), f"{injected}: warned {said}"
        assert injected.kind == "delete-marker" or injected.path in said, f"{injected}: {said}"
        return
    _, state = fresh_target()
    before = copy.deepcopy(state)
    with pytest.raises(BaseException) as caught:  # DCP wraps the error in its own
        dcp.load(state, storage_reader=TieredReader(first), checkpoint_id=ID)
    assert_same(before, state, f"{injected}: a failed load changed the state")
    message = str(caught.value)
    assert f"{injected.tier} (" in message, f"{injected}: the error names no tier: {message}"
    assert _names_the_damage(message, injected, world), f"{injected}: the error says {message}"
    assert injected.kind == "delete-marker" or injected.path in message, f"{injected}: {message}"
    assert f"tierstore verify {ID}" in message, f"{injected}: the error says not what to do"


def check_verify(world: World, injected: Injected) -> None:
    """(b): ``tierstore verify ID``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--config", str(world.config_file), "verify", ID])
    said = out.getvalue() + err.getvalue()
    if injected.kind == "delete-marker":
        assert code == 0 and f"{injected.tier}:" not in said, f"{injected}: {said}"
        return
    assert code == 1, f"{injected}: verify exited {code}: {said}"
    flagged = [line for line in said.splitlines() if line.startswith(f"{injected.tier}: MISMATCH")]
    assert _names_the_damage("\n".join(flagged), injected, world), f"{injected}: {said}"


def check_listing(world: World, injected: Injected) -> None:
    """(c): ``ls`` and ``latest_committed``."""
    config = world.config()
    listed = {entry.checkpoint_id: entry.tiers for entry in Catalog(config).listings()}
    assert set(listed) == {ID, OLDER}, f"{injected}: {listed}"
    if injected.kind in UNREADABLE_MARKER:
        assert injected.tier not in listed[ID], f"{injected}: listed without a marker: {listed}"
    assert latest_committed(config, collective=False) == ID, injected


def check_promotion(world: World, injected: Injected) -> None:
    """(d): a promoter pass copies nothing damaged, says what it refused, promotes the rest."""
    with _warnings() as warned:
        code = Promoter(world.config()).run(once=True)
    said = " | ".join(warned)
    below = TIERS[TIERS.index(injected.tier) + 1 :]
    for name in below:
        tier = world.tier(name)
        assert tier.exists(marker_path(OLDER)), f"{injected}: {OLDER} not promoted to {name}"
        with contextlib.suppress(FileNotFoundError):
            manifest = read_manifest(tier, ID, trust=MarkerTrust())
            assert manifest.generation == world.generation, f"{injected}: {name}: {manifest}"
            assert copy_problems(tier, manifest, verify=True) == [], f"{injected}: {name}"
    if injected.kind in UNREADABLE_MARKER:  # not a committed copy: nothing to promote, no error
        assert code == 0, f"{injected}: the pass failed: {said}"
        return
    assert code == 1, f"{injected}: the pass reported no failure: {said}"
    assert injected.tier in said and _names_the_damage(said, injected, world), (
        f"{injected}: the pass said {said}"
    )
    for name in below:
        assert not world.tier(name).exists(marker_path(ID)), f"{injected}: promoted to {name}"


def run_case(world: World, tier: str, kind: str, *, promote: bool = False) -> Injected:
    """Inject one fault, check (a)-(c) (with ``promote``: (d)), put every tier back as it was."""
    seed = seed_of(tier, kind, "promote" if promote else "committed")
    injected = inject(world.tier(tier), ID, kind, world.foreign, seed)
    print(f"case {tier}/{kind}{' before promotion' if promote else ''}: seed {seed}, damaged {injected.path}")
    try:
        if promote:
            check_promotion(world, injected)
        else:
            check_restore(world, injected)
            check_verify(world, injected)
            check_listing(world, injected)
    finally:
        world.snapshot.restore()
    assert world.snapshot.differences() == [], "the tiers are not back as they were"
    return injected


@pytest.mark.parametrize(("tier", "kind"), QUICK)
def test_corruption_is_detected_and_the_load_falls_back(world: World, tier: str, kind: str) -> None:
    run_case(world, tier, kind)


@pytest.mark.parametrize(("tier", "kind"), QUICK_PROMOTION)
def test_a_damaged_copy_is_never_promoted(unpromoted: Unpromoted, tier: str, kind: str) -> None:
    run_case(unpromoted[tier], tier, kind, promote=True)


@pytest.mark.slow  # every tier and kind, twice: make test runs it, make quick does not
def test_detected_every_injected_fault(world: World, unpromoted: Unpromoted) -> None:
    cases = [(world, tier, kind, False) for tier in TIERS for kind in KINDS]
    cases += [(unpromoted[tier], tier, kind, True) for tier in SOURCES for kind in KINDS]
    missed: list[str] = []
    rows: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for setup, tier, kind, promote in cases:
        try:
            run_case(setup, tier, kind, promote=promote)
            rows[kind].append("detected")
        except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - a crash is a miss too
            missed.append(f"{tier}/{kind}{' (promotion)' if promote else ''}: {exc!r}")
            rows[kind].append("MISSED")
    header = [f"{t} (copies everywhere)" for t in TIERS]
    header += [f"{t} (before promotion)" for t in SOURCES]
    print("kind | " + " | ".join(header))
    for kind, row in rows.items():
        print(f"{kind} | " + " | ".join(row))
    detected = len(cases) - len(missed)
    print(f"detected {detected} of {len(cases)} injected")
    assert not missed, "\n".join(missed)
