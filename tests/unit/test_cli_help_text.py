"""Every help string of the ``stream-rl`` command tree reaches ``--help`` whole: no ``[word]`` eaten as rich
markup (issue 40: ``evaluate --help`` read "held-out sets of : follow the run" for "sets of [eval]: follow").

The tree is walked through click (typer's own command objects), so a command added later is checked too."""

from __future__ import annotations

import re

import typer
from typer.testing import CliRunner

from stream_rl.cli.main import app

BRACKETED = re.compile(r"\[[^\[\]\n]+\]")
_BOX = re.compile(r"[\u2500-\u257f]")  # rich's panel borders


def _commands(command, path: tuple[str, ...] = ()):
    yield path, command
    if hasattr(command, "commands"):  # a group (typer's own click classes)
        for name, sub in sorted(command.commands.items()):
            yield from _commands(sub, (*path, name))


def _flat(text: str) -> str:
    """Without borders and whitespace, so a wrapped line or a table column cannot split a word."""
    return re.sub(r"\s+", "", _BOX.sub("", text))


def _source_texts(command) -> list[str]:
    texts = [command.help or "", command.short_help or ""]
    texts += [getattr(param, "help", None) or "" for param in command.params]  # options and typer arguments
    return texts


def test_every_bracketed_word_of_every_help_string_is_printed():
    root = typer.main.get_command(app)
    runner = CliRunner()
    missing, checked = [], 0
    for path, command in _commands(root):
        if getattr(command, "hidden", False):
            continue
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
        assert result.exit_code == 0, (path, result.output)
        shown = _flat(result.output)
        for text in _source_texts(command):
            for word in BRACKETED.findall(text):
                checked += 1
                if _flat(word) not in shown:
                    missing.append(f"stream-rl {' '.join(path)} --help lacks {word}")
    assert checked >= 1  # evaluate's [eval] at least: the walk reached the help strings
    assert not missing, "\n".join(missing)


def test_evaluate_help_names_the_eval_section():
    result = CliRunner().invoke(app, ["evaluate", "--help"], env={"COLUMNS": "200"})
    assert "held-out sets of [eval]: follow the run" in " ".join(result.output.split())
