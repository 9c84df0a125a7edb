"""The README's Python snippets run as written (tiny checkpoints, CPU), so the README cannot
drift from the code; its CLI flag table lists exactly the CLIs' flags; its quickstart stays short."""

import argparse
import itertools
import os
import re
from pathlib import Path

import pytest

import gemma4_flex_inference
import qwen3_flex_inference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
FLAG_TABLE_HEADER = "| flag | default | what it does |"
QUICKSTART_MAX_LINES = 40


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 6, f"{len(SNIPPETS)} python snippets in README.md"


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=[f"snippet{i + 1}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs_as_written(tiny_dir, index, monkeypatch, capsys):
    assert tiny_dir == ROOT / "checkpoints" / "tiny", "the snippets name checkpoints/tiny"
    monkeypatch.chdir(ROOT)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):  # a plain process, not under torchrun
        monkeypatch.delenv(name, raising=False)
    namespace = {"__name__": f"readme_snippet_{index + 1}"}
    cuda = qwen3_flex_inference.torch.backends.cuda
    was_cudnn_sdp = cuda.cudnn_sdp_enabled()  # the TRL snippet turns it off for its trainer, as users should
    try:
        exec(compile(SNIPPETS[index], f"README.md snippet {index + 1}", "exec"), namespace)
    finally:
        cuda.enable_cudnn_sdp(was_cudnn_sdp)
    assert os.getcwd() == str(ROOT)


def test_the_quickstart_comes_first_and_is_at_most_40_lines():
    lines = README.splitlines()
    headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert headings and lines[headings[0]] == "## Quickstart", "the first section is the quickstart"
    num_lines = headings[1] - headings[0]  # from its heading up to the next section's
    assert num_lines <= QUICKSTART_MAX_LINES, f"the quickstart has {num_lines} lines"


def readme_table_flags(readme: str) -> list[str]:
    """The flags the README's CLI table lists: the `--flag`s in the first cell of each row."""
    lines = readme.splitlines()
    assert lines.count(FLAG_TABLE_HEADER) == 1, f"README.md needs one table headed {FLAG_TABLE_HEADER!r}"
    start = lines.index(FLAG_TABLE_HEADER)
    assert re.fullmatch(r"\|(\s*-+\s*\|){3}", lines[start + 1]), lines[start + 1]
    flags = []
    for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :]):
        cell = line.split("|")[1]
        row_flags = re.findall(r"`(--[\w-]+)`", cell)
        assert row_flags, f"a row of the flag table names no flag: {line!r}"
        flags += row_flags
    return flags


class Parsed(Exception):
    """Raised in place of parsing: the parser a CLI built has been recorded."""


def cli_parser(module, monkeypatch) -> argparse.ArgumentParser:
    """The parser `module.main` builds, recorded as it starts to parse (nothing runs)."""
    recorded = []

    def record(self, args=None, namespace=None):
        recorded.append(self)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
    with pytest.raises(Parsed):
        module.main([])
    return recorded[0]


def long_options(parser: argparse.ArgumentParser) -> set[str]:
    options = {option for action in parser._actions for option in action.option_strings if option.startswith("--")}
    return options - {"--help"}


@pytest.mark.parametrize("module", [qwen3_flex_inference, gemma4_flex_inference], ids=["qwen3", "gemma4"])
def test_the_flag_table_lists_exactly_the_cli_flags(module, monkeypatch):
    table_flags = readme_table_flags(README)
    assert len(table_flags) == len(set(table_flags)), f"flags listed twice: {sorted(table_flags)}"
    options = long_options(cli_parser(module, monkeypatch))
    assert set(table_flags) == options, (
        f"missing from README.md's flag table: {sorted(options - set(table_flags))}; "
        f"in the table but not a flag: {sorted(set(table_flags) - options)}"
    )


def test_the_flag_table_check_sees_a_flag_without_a_row():
    parser = qwen3_flex_inference.build_arg_parser("unused", "unused")
    parser.add_argument("--a_new_flag", action="store_true")
    assert set(readme_table_flags(README)) != long_options(parser)
