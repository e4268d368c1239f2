"""The `optimisers` command: `bench` is wired to the benchmark's own parser; `--version`."""

from __future__ import annotations

import importlib.metadata

import pytest

from optimisers.tools import cli


def test_bench_subcommand_reaches_the_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_bench_rejects_unknown_options_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--nonsense"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --nonsense" in capsys.readouterr().err


def test_top_level_help_lists_both_commands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "demo" in out and "bench" in out


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"optimisers {importlib.metadata.version('optimisers')}\n"
