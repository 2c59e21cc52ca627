"""Just enough shell parsing to check the commands in deploy/: continuation lines, simple
assignments, ``${VAR}`` expansion, ``bash -c '...'`` scripts, and the argv of one program."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)|\$([A-Za-z_][A-Za-z0-9_]*)")
_NAME = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?=[}:])|\$([A-Za-z_][A-Za-z0-9_]*)")
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(\S.*)$")
_REDIRECTS = {">", ">>", "<", ">&"}


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined; comments and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def assignments(text: str, env: dict[str, str]) -> dict[str, str]:
    """``NAME=value`` lines at the start of a line, expanded in order (``${X:-default}`` works)."""
    found = dict(env)
    for line in logical_lines(text):
        match = _ASSIGNMENT.match(line.strip())
        if match and match.group(2).startswith("$("):  # a command's output: known only there
            found[match.group(1)] = f"<{match.group(1)}>"
        elif match:
            (value,) = shlex.split(expand(match.group(2), found, strict=False))
            found[match.group(1)] = value
    return found


def variables(text: str) -> set[str]:
    """Every ``$VAR`` / ``${VAR}`` a script refers to."""
    return {m.group(1) or m.group(2) for m in _VAR.finditer(text)}


def expand(text: str, env: dict[str, str], *, strict: bool = True) -> str:
    """Replace ``${VAR}``, ``${VAR:-default}`` (defaults may nest) and ``$VAR``; with ``strict`` an
    unknown variable without a default raises :class:`KeyError`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        match = _NAME.match(text, i)
        if match is None:
            out.append(text[i])
            i += 1
            continue
        name = match.group(1) or match.group(2)
        end, default = match.end(), None
        if text.startswith(":-", end) and match.group(1):
            depth, j = 1, end + 2
            while depth:  # find the brace that closes ${NAME:-...}
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            default, end = text[match.end() + 2 : j - 1], j
        elif match.group(1):
            end += 1  # the closing brace of ${NAME}
        if name in env:
            out.append(env[name])
        elif default is not None:
            out.append(expand(default, env, strict=strict))
        elif strict:
            raise KeyError(f"${name} is not defined where this command runs")
        else:
            out.append(text[i:end])
        i = end
    return "".join(out)


def commands(text: str, env: dict[str, str]) -> list[list[str]]:
    """The argv of every simple command, including those inside ``bash -c 'SCRIPT' ARG0 ARGS``
    (whose ``$0`` and ``"$@"`` become ARG0 and ARGS, and whose variables expand from ``env``)."""
    found: list[list[str]] = []
    for line in logical_lines(text):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        for argv in _split_on_operators(tokens):
            at = argv.index("-c") if "-c" in argv else -1
            if at > 0 and argv[at - 1] in ("bash", "sh"):
                script, args = argv[at + 1], argv[at + 2 :]
                inner = script.replace('"$0"', shlex.quote(args[0]) if args else "")
                inner = inner.replace('"$@"', shlex.join(args[1:]))
                found += commands(inner, env)
            outer = argv[: at + 2] if at > 0 and argv[at - 1] in ("bash", "sh") else argv
            found.append([expand(token, env) for token in outer])
    return found


def _split_on_operators(tokens: list[str]) -> list[list[str]]:
    """Simple commands between ``&``, ``|``, ``;``, ``&&``, ``||``; redirections dropped."""
    parts: list[list[str]] = [[]]
    skip = False
    for token in tokens:
        if skip:
            skip = False
        elif token in _REDIRECTS:
            if parts[-1] and parts[-1][-1].isdigit():
                parts[-1].pop()  # the 2 of 2>/dev/null
            skip = True
        elif set(token) <= set("&|;()"):
            parts.append([])
        else:
            parts[-1].append(token)
    return [p for p in parts if p]


def invocations(argvs: list[list[str]], program: str) -> list[list[str]]:
    """The arguments of every call of ``program`` (by basename; ``exec`` and ``srun ...`` prefixes
    skipped)."""
    calls = []
    for argv in argvs:
        for index, token in enumerate(argv):
            if Path(token).name == program:
                calls.append(argv[index + 1 :])
                break
    return calls
