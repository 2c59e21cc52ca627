"""What the ``tierstore`` command says when something is off: one clear line, the right exit code.

Global options after the command, durations wherever a command takes one, an unknown id on restore,
a tier the user excluded, an unquoted ``{node}`` in flow-style YAML. All in-process (``main([...])``).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tierstore import TieredWriter
from tierstore.cli import EXIT_ERROR, build_parser, main
from tierstore.config import load_config
from tierstore.promote.sidecar import Promoter


@pytest.fixture
def config_file(tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]) -> Path:
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump({"namespace": "run", "tiers": tier_specs("memory", "local")}))
    return path


def save(path: Path, *checkpoint_ids: str) -> None:
    """Small async saves (they record the stall ``advise`` reads)."""
    writer = TieredWriter(str(path))
    for number, checkpoint_id in enumerate(checkpoint_ids):
        state = {"w": torch.arange(4096, dtype=torch.float32) + number}
        dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id).result()
    writer.close()


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a failed command wrote to stderr (asserted to be one)."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tierstore: error: "), err
    return err


# -- global options after the command ------------------------------------------------------------


def test_global_options_are_accepted_after_the_command(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", "--config", str(config_file), "--node", "0", "-v"]) == 0
    assert "no committed checkpoints" in capsys.readouterr().out
    assert main(["--config", str(config_file), "ls", "--json"]) == 0  # the old form still works
    assert json.loads(capsys.readouterr().out) == []


def test_an_option_after_the_command_overrides_the_one_before_and_absent_keeps_it(
    config_file: Path, tmp_path: Path
) -> None:
    parser = build_parser()
    missing = str(tmp_path / "missing.yaml")
    after = parser.parse_args(["--config", missing, "--node", "3", "ls", "--config", "x.yaml"])
    assert (after.config, after.node, after.verbose, after.quiet) == ("x.yaml", 3, False, False)
    before = parser.parse_args(["--config", missing, "-q", "ls"])
    assert (before.config, before.node, before.quiet) == (missing, None, True)
    assert main(["--config", missing, "ls", "--config", str(config_file)]) == 0


def test_verbose_and_quiet_together_are_refused(config_file: Path) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--config", str(config_file), "-v", "ls", "-q"])
    assert stopped.value.code == EXIT_ERROR


# -- durations -------------------------------------------------------------------------------------


def test_advise_takes_durations_like_the_configuration(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(config_file, "step_0001", "step_0002")
    assert main(["--config", str(config_file), "advise", "--mtbf", "6h", "--restart", "1m", "--json"]) == 0
    words = json.loads(capsys.readouterr().out)
    assert main(["--config", str(config_file), "advise", "--mtbf", "21600", "--restart", "60", "--json"]) == 0
    seconds = json.loads(capsys.readouterr().out)
    assert (words["mtbf_s"], words["restart_s"]) == (21600.0, 60.0)
    assert words["daly_s"] == seconds["daly_s"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["advise", "--mtbf", "6 hours"], "expected a duration such as 10s, 5m or 1h"),
        (["advise", "--mtbf", "0"], "expected a positive interval"),
        (["drill", "--entry", "m:f", "--loss-log", "x", "--timeout", "soon"], "--timeout"),
    ],
)
def test_a_bad_duration_is_refused_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["--config", "x.yaml", *argv])
    assert stopped.value.code == EXIT_ERROR
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["advise", "--mtbf", "6h", "--last", "0"], "argument --last: expected a whole number >= 1"),
        (["advise", "--mtbf", "6h", "--last", "-1"], "argument --last: expected a whole number >= 1"),
        (["promote", "--metrics-port", "70000"], "argument --metrics-port: expected a port 0-65535"),
        (["promote", "--metrics-port", "-1"], "argument --metrics-port: expected a port 0-65535"),
    ],
)
def test_counts_and_ports_out_of_range_are_refused_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--config", "x.yaml", *argv])
    assert stopped.value.code == EXIT_ERROR
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_every_duration_option_reads_units() -> None:
    parser = build_parser()
    drill = parser.parse_args(["drill", "--entry", "m:f", "--loss-log", "x", "--timeout", "10m"])
    watch = parser.parse_args(["ls", "--watch", "--interval", "500ms"])
    advice = parser.parse_args(["advise", "--mtbf", "2d", "--restart", "90s"])
    assert (drill.timeout, watch.interval, advice.mtbf, advice.restart) == (600, 0.5, 172800, 90)


# -- restore ---------------------------------------------------------------------------------------


def test_restore_of_an_unknown_id_names_it_the_tiers_searched_and_what_is_there(
    config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    assert main(["--config", str(config_file), "restore", "step_0404", "--to", out]) == EXIT_ERROR
    err = error_line(capsys)
    assert ":;" not in err
    assert "checkpoint 'step_0404'" in err
    assert "memory (" in err and "local (" in err
    assert err.rstrip().endswith("nothing is committed in the tiers searched")

    save(config_file, "step_0001", "step_0002")
    assert main(["--config", str(config_file), "restore", "step_0404", "--to", out]) == EXIT_ERROR
    err = error_line(capsys)
    assert err.rstrip().endswith("committed in the tiers searched, newest first: step_0002, step_0001")
    assert (
        main(["--config", str(config_file), "restore", "step_0404", "--to", out, "--tier", "local"])
        == EXIT_ERROR
    )
    assert error_line(capsys).rstrip().endswith("nothing is committed in tier local")
    assert not Path(out).exists()


def test_restore_from_a_named_tier_does_not_warn_of_the_tiers_not_asked_for(
    config_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(config_file, "step_0001")
    Promoter(load_config(config_file)).run_once()  # now in memory and local
    with caplog.at_level(logging.WARNING):
        assert (
            main(
                [
                    "--config",
                    str(config_file),
                    "restore",
                    "step_0001",
                    "--to",
                    str(tmp_path / "out"),
                    "--tier",
                    "local",
                ]
            )
            == 0
        )
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (tmp_path / "out" / ".metadata").exists()


def test_restore_still_warns_of_a_tier_it_had_to_skip(
    config_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(config_file, "step_0001")
    Promoter(load_config(config_file)).run_once()
    memory = next((tmp_path / "memory").rglob("*.distcp"))
    memory.write_bytes(memory.read_bytes()[:-1])  # a truncated file: the choice skips memory
    with caplog.at_level(logging.WARNING):
        assert (
            main(["--config", str(config_file), "restore", "step_0001", "--to", str(tmp_path / "out")]) == 0
        )
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "skipping tier memory" in warned


# -- the configuration file ------------------------------------------------------------------------


def test_an_unquoted_placeholder_in_flow_style_yaml_gets_a_hint_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "flow.yaml"
    path.write_text(f"namespace: run\ntiers:\n  - {{name: ram, type: memory, path: {tmp_path}/{{node}}}}\n")
    assert main(["--config", str(path), "ls"]) == EXIT_ERROR
    err = error_line(capsys)
    assert f"{path}: line 3, column" in err
    assert f"quote the value: path: '{tmp_path}/{{node}}'" in err


def test_yaml_errors_without_a_placeholder_get_no_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("tiers:\n  - {name: ram, type: memory, path: '/x/{node}', keep: [}\n")
    assert main(["--config", str(path), "ls"]) == EXIT_ERROR
    err = error_line(capsys)
    assert "malformed YAML" in err and "quote the value" not in err


# -- a reader that goes away -----------------------------------------------------------------------


def test_a_reader_closing_the_pipe_ends_the_listing_quietly(config_file: Path) -> None:
    """``tierstore ls | head``: the command stops as a Unix tool does on SIGPIPE, without an error."""
    save(config_file, "step_1")
    listing = subprocess.Popen(
        [sys.executable, "-m", "tierstore", "--config", str(config_file), "ls", "--limit", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert listing.stdout is not None
    listing.stdout.close()  # the reader is gone before the command writes
    _out, err = listing.communicate(timeout=120)
    assert listing.returncode == 128 + signal.SIGPIPE
    assert "Broken pipe" not in err and "error" not in err, err


# -- the promoter's metrics address ----------------------------------------------------------------


def promote_on(config_file: Path, port: int, addr: str) -> subprocess.CompletedProcess[str]:
    argv = ["--config", str(config_file), "promote", "--once", "--metrics-port", str(port)]
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *argv, "--metrics-addr", addr],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("addr", "message"),
    [
        ("127.0.0.1:9400", "malformed address '127.0.0.1:9400' (the port goes to --metrics-port)"),
        ("local host", "malformed address 'local host'"),
        ("no-such-host.invalid", "--metrics-addr no-such-host.invalid: not resolvable"),
    ],
)
def test_a_bad_metrics_address_is_told_what_is_wrong_with_it(
    config_file: Path, addr: str, message: str
) -> None:
    done = promote_on(config_file, 0, addr)
    assert done.returncode == EXIT_ERROR
    assert message in done.stderr and "free port" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_metrics_port_in_use_is_told_to_choose_a_free_one(config_file: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = promote_on(config_file, port, "127.0.0.1")
    assert done.returncode == EXIT_ERROR
    assert "Address already in use (choose a free port with --metrics-port" in done.stderr, done.stderr


# -- restore and drill check their arguments before importing torch --------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["restore", "../x", "--to", "{out}"], "../x"),
        (["restore", "step_1", "--to", "{full}"], "exists and is not empty"),
        (["restore", "step_1", "--to", "{out}", "--tier", "tape"], "no tier named 'tape'"),
        (["drill", "--entry", "nocolon", "--loss-log", "{log}"], "expected module:function"),
        (
            ["drill", "--entry", "m:f", "--loss-log", "{log}", "--steps", "2"],
            "--steps 2: expected at least 3",
        ),
        (["drill", "--entry", "m:f", "--loss-log", "{log}", "--tier", "tape"], "no tier named 'tape'"),
        (["drill", "--entry", "m:f", "--loss-log", "{out}/none.jsonl"], "none.jsonl"),
    ],
)
def test_restore_and_drill_refuse_bad_arguments_without_loading_torch(
    config_file: Path, tmp_path: Path, argv: list[str], message: str
) -> None:
    """Importing torch takes seconds: a typo is told before it, in one line."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept").write_text("x")
    (tmp_path / "loss.jsonl").write_text("")
    where = {
        "out": str(tmp_path / "out"),
        "full": str(tmp_path / "full"),
        "log": str(tmp_path / "loss.jsonl"),
    }
    args = ["--config", str(config_file), *[a.format(**where) for a in argv]]
    code = f"import sys; from tierstore.cli import main; c = main({args!r}); print(c, 'torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.split() == [str(EXIT_ERROR), "False"], done.stdout + done.stderr
    assert done.stderr.startswith("tierstore: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr
