"""No secret in any output (issue 24, item 7): with a recognisable signing key in the environment, a
save, a promotion, ``ls``, ``verify``, ``status``, ``gc`` and ``restore`` (all with ``-v``), and the
refusals a wrong key causes, leave the key (raw, hex or base64) in no log line, CLI output, metrics
file, marker or record; and two runs in one set of roots under different namespaces never list,
promote, retain or clean up each other's data."""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tierstore import Catalog, TieredReader, TieredWriter
from tierstore.cli import main
from tierstore.config import Config, load_config
from tierstore.promote.sidecar import Promoter

KEY = "SeCrEt-K3y-" + "q7" * 16
OTHER_KEY = "An0ther-SeCrEt-" + "z9" * 16


def _forms(key: str) -> list[bytes]:
    raw = key.encode()
    return [
        raw,
        raw.hex().encode(),
        raw.hex().upper().encode(),
        base64.b64encode(raw),
        base64.urlsafe_b64encode(raw),
    ]


def _save(config: Config | str, checkpoint_id: str, value: float = 1.0) -> None:
    state = {"w": torch.full((256,), value), "step": 3}
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)


def test_the_key_appears_in_no_output(
    tmp_path: Path,
    tier_specs: Callable[..., list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "tierstore.yaml"
    body = {
        "namespace": "run",
        "tiers": tier_specs("memory", "local", "shared"),
        "metrics": {"directory": str(tmp_path / "metrics")},
        "signing": {"require": True},
    }
    path.write_text(yaml.safe_dump(body))
    for index in range(3):
        _save(str(path), f"step_{index:06d}", float(index))
    cfg = ["--config", str(path)]
    outputs: list[str] = []
    for command in (
        ["promote", "--once"],
        ["ls"],
        ["ls", "--json"],
        ["verify", "step_000002"],
        ["verify", "--all"],
        ["status"],
        ["gc"],
        ["restore", "step_000002", "--to", str(tmp_path / "out"), "--json"],
    ):
        main([*cfg, "-v", *command])
        captured = capsys.readouterr()
        outputs += [captured.out, captured.err]
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", OTHER_KEY)  # every marker is now mis-signed
    for command in (["ls"], ["verify", "step_000002"], ["status"], ["promote", "--once"]):
        main([*cfg, "-v", *command])
        captured = capsys.readouterr()
        outputs += [captured.out, captured.err]
    with pytest.raises(BaseException) as refused:  # DCP wraps it
        reader = TieredReader(load_config(path), collective=False)
        dcp.load({"w": torch.zeros(256), "step": 0}, storage_reader=reader, checkpoint_id="x")
    outputs.append(str(refused.value))
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", "short")
    main([*cfg, "-v", "ls"])
    captured = capsys.readouterr()
    outputs += [captured.out, captured.err]
    assert "signature does not match" in "".join(outputs)  # the refusals were exercised
    assert "shorter than 16 bytes" in "".join(outputs)
    texts = [o.encode() for o in outputs] + [caplog.text.encode()]
    for root, _dirs, files in os.walk(tmp_path):  # markers, records, metrics files, the export
        texts += [Path(root, name).read_bytes() for name in files if name != "tierstore.yaml"]
    assert any(b"hmac-sha256:" in t for t in texts)  # markers are there, and signed
    for form in _forms(KEY) + _forms(OTHER_KEY):
        assert not [t[:80] for t in texts if form in t], form


def test_two_namespaces_in_one_root_never_touch_each_others_data(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    tiers = {"memory": {"keep": 1}, "local": {"keep": 1}}
    promote = {"stale_after": "1s", "interval": "1s"}
    run_a = make_config("memory", "local", namespace="a", tiers=tiers, promote=promote)
    run_b = make_config("memory", "local", namespace="b", tiers=tiers, promote=promote)
    for checkpoint_id in ("x", "y", "z"):  # the same ids in both runs
        _save(run_a, checkpoint_id, 1.0)
        _save(run_b, checkpoint_id, 2.0)
    stray = tmp_path / "memory" / "0" / "b" / "z" / "g0000000000001-leftover"
    stray.mkdir(parents=True)
    (stray / "junk").write_bytes(b"b's, uncommitted")
    os.utime(stray / "junk", (1.0, 1.0))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "/b/" in f"/{p}/")
    for _ in range(2):
        assert Promoter(run_a).run(once=True) == 0
        assert main(["--config", _yaml(run_a, tmp_path), "gc"]) == 0
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "/b/" in f"/{p}/")
    assert after == before  # nothing of run b was promoted, retained away or cleaned up by a
    assert not (tmp_path / "local" / "0" / "b").exists() or not any(
        (tmp_path / "local" / "0" / "b").iterdir()
    )
    assert [(item.checkpoint_id, item.tiers) for item in Catalog(run_a).listings()] == [
        ("z", ("memory", "local"))
    ]
    state = {"w": torch.zeros(256), "step": 0}
    dcp.load(state, storage_reader=TieredReader(run_b, collective=False), checkpoint_id="x")
    assert torch.equal(state["w"], torch.full((256,), 2.0))


def _yaml(config: Config, tmp_path: Path) -> str:
    path = tmp_path / f"{config.namespace}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude={"origin"})))
    return str(path)
