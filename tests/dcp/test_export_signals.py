"""``tierstore restore`` stopped by SIGTERM (a timeout, a job kill) leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml

from tierstore import TieredWriter
from tierstore.config import Config
from tierstore.ids import ACTIVITY_DIR


def test_sigterm_mid_export_removes_the_temporary_directory_and_the_read_record(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory")
    state = {f"w{i}": torch.randn(8 * 2**20 // 4) for i in range(48)}  # 384 MiB: a slow export
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="big")
    config_file = tmp_path / "tierstore.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude={"origin"})))
    dest = tmp_path / "out" / "big"
    dest.parent.mkdir()

    export = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "--config",
            str(config_file),
            "restore",
            "big",
            "--to",
            str(dest),
        ],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".big.export-") for p in dest.parent.iterdir()):
        assert export.poll() is None, "the export ended before it could be stopped"
        assert time.monotonic() < deadline, "no temporary directory appeared"
        time.sleep(0.002)
    export.send_signal(signal.SIGTERM)
    assert export.wait(60) == 128 + signal.SIGTERM

    assert list(dest.parent.iterdir()) == [], "the temporary directory was left behind"
    records = [info.path for info in config.make_tier("memory", node=0).find(ACTIVITY_DIR)]
    assert not [path for path in records if "/read~big~" in path], records
