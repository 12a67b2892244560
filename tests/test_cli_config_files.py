"""``--config FILE``: a YAML syntax error is one line naming the file, the line and the column."""

from __future__ import annotations

import sys

import pytest

from lit_mhar.cli import main


@pytest.mark.parametrize("command", [["sweep", "run"], ["fit"], ["validate"]])
def test_a_config_file_with_a_yaml_syntax_error_is_one_line_naming_it(command, tmp_path, monkeypatch, capsys):
    """A sweep file with a syntax error named the line but not the file, after 28 lines of usage."""
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "my sweep.yaml"
    bad.write_text("study: x\nspace:\n  - residual: [prenorm\n  heads: 1\n")
    monkeypatch.setattr(sys, "argv", ["lit-mhar", *command, "--config", str(bad)])
    assert main() == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"lit-mhar {' '.join(command)}: error: --config {bad}: not valid YAML: expected ',' or ']', but got ':' at line 4, column 8 "
        "(while parsing a flow sequence at line 3); correct the file (LIT_MHAR_DEBUG=1 shows the traceback)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my sweep.yaml"]  # nothing created


def test_a_valid_config_file_and_an_inline_config_still_parse(tmp_path, capsys):
    good = tmp_path / "fit.yaml"
    good.write_text("model:\n  lr: 0.01\n")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(good), "--print_config"])
    assert exit_.value.code == 0 and "lr: 0.01" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "model: {lr: 0.02}", "--print_config"])
    assert exit_.value.code == 0 and "lr: 0.02" in capsys.readouterr().out
