"""The command line as assembled from its command-group modules: every command is listed and has a help page,
and bad input exits with its error class's code and a message, not a traceback."""

from __future__ import annotations

import pytest

from recstack.cli.main import main

COMMANDS = ["train", "tune", "eval", "predict", "data", "plan", "analyze-a2a", "exfm", "export", "serve"]
SUBCOMMANDS = [["data", "prepare"], ["data", "inspect"], ["data", "synth"], ["exfm", "run"], ["exfm", "movielens"]]


def test_help_lists_every_command_group(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "{" + ",".join(COMMANDS) + "}" in out  # in this order
    for command in COMMANDS:
        assert f"\n    {command} " in out, command  # each with its help line


@pytest.mark.parametrize("argv", [[c] for c in COMMANDS] + SUBCOMMANDS, ids=" ".join)
def test_every_command_has_a_help_page(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: recstack {' '.join(argv)}")


@pytest.mark.parametrize(("override", "message"), [
    ("model.interaction=x", "model.interaction: 'x' is not one of dot, cat, dcn"),
    ("model.qr_operation=concat", "model.qr_operation: 'concat' is not one of mult, add"),
    ("optim.dense=true", "optim.dense: True is not one of sgd, adagrad, adam"),  # a choice is a string
    ("optim.sparse=lamb", "optim.sparse: 'lamb' is not one of sgd, rowwise_adagrad, adam"),
    ("dist.sharding=2", "dist.sharding: 2 is not one of data_parallel, table_wise, row_wise, column_wise, "
                        "table_row_wise"),
    ("dist.forward_codec=fp64", "dist.forward_codec: 'fp64' is not one of fp32, fp16, bf16, fp8, int8, eb"),
    ("dist.backward_codec=int4", "dist.backward_codec: 'int4' is not one of fp32, fp16, bf16, fp8, int8, eb"),
    ("memory.cache_policy=mru", "memory.cache_policy: 'mru' is not one of lru, lfu"),
])
def test_a_value_outside_the_choices_exits_2_naming_field_and_choices(override: str, message: str,
                                                                       capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recstack train: error: ") and message in err and "Traceback" not in err
