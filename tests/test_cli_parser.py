"""Every command and subcommand of ``sylvie-comm``: its options, defaults, types and help text.

The snapshot ``test_cli_parser.json`` was taken from the parser as it was written before it became a table of
commands; the table must build the same command line (regenerate it only for a deliberate change of the CLI:
``python tests/test_cli_parser.py > tests/test_cli_parser.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from sylvie_comm import cli

SNAPSHOT = Path(__file__).with_name("test_cli_parser.json")
COLUMNS = "120"


def _type_name(kind: object) -> str | None:
    return None if kind is None else getattr(kind, "__qualname__", type(kind).__name__)


def _action(action: argparse.Action) -> dict[str, Any]:
    return {
        "options": list(action.option_strings), "dest": action.dest, "default": repr(action.default),
        "type": _type_name(action.type), "choices": repr(action.choices), "required": action.required,
        "nargs": repr(action.nargs), "const": repr(action.const), "help": action.help,
        "metavar": repr(action.metavar), "action": type(action).__name__,
    }  # fmt: skip


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{"bench ddp": {"actions": [...], "help_text": ...}, ...}`` for the parser and every subparser under it."""
    out: dict[str, Any] = {}
    actions: list[dict[str, Any]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            actions.append({"subparsers": action.dest, "required": action.required, "choices": helps})
            for name, sub in action.choices.items():
                out.update(walk(sub, (*path, name)))
        else:
            actions.append(_action(action))
    out[" ".join(path)] = {"actions": actions, "help_text": parser.format_help()}
    return out


def test_every_command_keeps_its_options_defaults_and_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", COLUMNS)
    expected = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(walk(cli.build_parser())))
    assert sorted(got) == sorted(expected)
    for command in expected:
        assert got[command]["actions"] == expected[command]["actions"], command
        assert got[command]["help_text"] == expected[command]["help_text"], command


def test_every_command_has_a_handler() -> None:
    """Each leaf command (and ``bench`` alone, which is ``--cleanup``) names the function that runs it."""

    def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        found = [path] if path and callable(parser.get_default("func")) else []
        for action in subs:
            for name, sub in action.choices.items():
                found += leaves(sub, (*path, name))
        return found

    found = leaves(cli.build_parser(), ())
    assert len(found) == len(json.loads(SNAPSHOT.read_text())) - 1, found


if __name__ == "__main__":
    os.environ["COLUMNS"] = COLUMNS
    json.dump(walk(cli.build_parser()), sys.stdout, indent=1, sort_keys=True)
    print()
