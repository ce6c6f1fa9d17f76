"""``megarl <command> --help`` prints that command's usage and exits 0, for every command."""

import pytest

from megarl.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_has_help(command, flag, capsys):
    assert main([command, flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: megarl {command}"), out[:200]
