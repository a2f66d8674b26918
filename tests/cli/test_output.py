"""cli/output.py: the one path every command's result and error takes to the terminal."""

from __future__ import annotations

import pytest

from dflash_cli.cli import output
from dflash_cli.errors import DflashError


def test_emit_prints_json_or_the_view_never_both(capsys: pytest.CaptureFixture[str]) -> None:
    shown: list[str] = []
    output.emit({"b": [1, "é"], "a": None}, True, lambda: shown.append("view"))
    assert capsys.readouterr().out == '{\n  "b": [\n    1,\n    "\\u00e9"\n  ],\n  "a": null\n}\n'
    assert shown == []
    output.emit({"a": 1}, False, lambda: shown.append("view"))
    assert capsys.readouterr().out == ""
    assert shown == ["view"]


def test_show_rows_piped_aligns_whole_values(capsys: pytest.CaptureFixture[str]) -> None:
    output.show_rows(("name", "notes"), [("demo", ""), ("qwen3-coder-next", "gated, MoE")])
    assert capsys.readouterr().out.splitlines() == [
        "name              notes",
        "demo",
        "qwen3-coder-next  gated, MoE",
    ]


def test_errors_print_error_and_fix_lines(capsys: pytest.CaptureFixture[str]) -> None:
    output.print_error(DflashError("no [bold]recipe[/] x", fix="dflash recipes list"))
    assert capsys.readouterr().err == "error: no [bold]recipe[/] x\nfix: dflash recipes list\n"
