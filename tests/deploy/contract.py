"""What the deploy files must agree with: tierstore's CLI, the example trainer's flags, the config."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from tests.deploy.tools import DEPLOY, ROOT
from tierstore.cli import build_parser
from tierstore.config import Config, load_config

CONFIG = DEPLOY / "tierstore.yaml"
TRAIN_GPT = ROOT / "examples" / "train_gpt.py"
TRAINER_FLAGS = {"--config", "--run-dir", "--steps", "--save-every"}
"""examples/train_gpt.py's documented flags (used until the script exists; then its argparse)."""
ALL_INTERFACES = "0.0.0.0"  # noqa: S104 - what a promoter others scrape must bind
"""``--metrics-addr`` wherever another pod or host scrapes the promoter."""
DRILL_FLAGS = {"--tier", "--world-size", "--entry", "--loss-log", "--steps", "--tolerance", "--prom-file"}
"""``tierstore drill``'s own flags as the deploy files use them (the step function's follow ``--``)."""


def config() -> Config:
    """deploy/tierstore.yaml, validated by tierstore itself (paths are those of the target hosts)."""
    return load_config(CONFIG, check_paths=False)


def parse_tierstore(args: list[str]) -> argparse.Namespace:
    """``tierstore ARGS`` as the CLI parses them (argparse exits on a mistake: turn it into a
    failure naming the command)."""
    try:
        return build_parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"tierstore does not accept: {' '.join(args)}") from exc


def trainer_flags() -> set[str]:
    """The flags examples/train_gpt.py accepts: read from its argparse calls when it exists."""
    if not TRAIN_GPT.exists():
        return TRAINER_FLAGS
    flags: set[str] = set()
    for node in ast.walk(ast.parse(TRAIN_GPT.read_text(), str(TRAIN_GPT))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {
                a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")
            }
    return flags


def check_trainer_args(args: list[str], config_path: str) -> None:
    """``train_gpt.py ARGS``: known flags only, ``--config`` is ``config_path``, ``--run-dir`` given."""
    flags = [a.split("=")[0] for a in args if a.startswith("--")]
    unknown = set(flags) - trainer_flags()
    assert not unknown, f"train_gpt.py has no {sorted(unknown)} (it has {sorted(trainer_flags())})"
    assert "--run-dir" in flags
    assert args[args.index("--config") + 1] == config_path


def check_batch_fits(args: list[str], world_size: int) -> None:
    """The trainer's global batch splits into ``world_size`` ranks x whole micro-batches (else
    train_gpt.py refuses to start on every node)."""
    sys.path.insert(0, str(TRAIN_GPT.parent))
    from train_gpt import build_parser  # the example's own parser: its defaults count too

    parsed = build_parser().parse_args(args)
    per_rank, rest = divmod(parsed.global_batch, world_size)
    assert not rest and per_rank % parsed.micro_batch == 0, (
        f"--global-batch {parsed.global_batch} does not split into {world_size} ranks x"
        f" micro-batches of {parsed.micro_batch}"
    )


def check_torchrun_args(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """torchrun's own parser (the pinned torch) on ``args``; returns it and the script's args."""
    from torch.distributed.run import get_args_parser

    try:
        parsed = get_args_parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"torchrun does not accept: {' '.join(args)}") from exc
    return parsed, list(parsed.training_script_args)


def node_local_prefixes() -> dict[str, str]:
    """Each node-local tier's directory above ``{node}``: the mount that must hold it."""
    prefixes = {}
    for tier in config().tiers:
        path = getattr(tier, "path", None)
        if path is not None and tier.type in ("memory", "local"):
            prefixes[tier.type] = str(Path(path.split("{node}")[0]))
    return prefixes
