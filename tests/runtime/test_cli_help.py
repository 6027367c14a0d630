"""Every subcommand's `--help` shows each option's default (issue #42: `generate --help` showed none)."""

import argparse
import re

import pytest

from spec_runtime import cli


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    top = cli._parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(sub.choices)
    from spec_train.cli import add_train_arguments  # `train` builds its parser on demand (cli._train)

    parsers["train"] = argparse.ArgumentParser(prog="spec-runtime train", formatter_class=cli.HelpFormatter)
    add_train_arguments(parsers["train"])
    return parsers


def _default(parser_name: str, action: argparse.Action):
    """The default a user gets: argparse's, or for `train`'s option fields, TrainConfig's."""
    if action.default is None and parser_name == "train":
        from spec_train.config import TrainConfig

        if action.dest == "device":  # the command's own default (TrainConfig's API default is cpu)
            return "auto"
        field = TrainConfig.model_fields.get(action.dest)
        return None if field is None else field.default
    return action.default


@pytest.mark.parametrize("name", ["generate", "demo", "real-model", "train"])
def test_every_option_shows_its_default(name) -> None:
    parser = _subparsers()[name]
    missing = []
    for action in parser._actions:
        default = _default(name, action)
        hidden = default is None or default is False or default in ("", [], (), argparse.SUPPRESS)
        if not action.option_strings or hidden or action.required:
            continue
        formatter = parser._get_formatter()  # this option's entry, as `--help` prints it
        formatter.add_argument(action)
        entry = "".join(formatter.format_help().split())  # argparse may wrap a long path inside itself
        if not re.search(rf"\(default:?{re.escape(''.join(str(default).split()))}\)", entry):
            missing.append(f"{max(action.option_strings, key=len)} (default {default!r})")
    assert not missing, f"`spec-runtime {name} --help` hides the defaults of {missing}"
