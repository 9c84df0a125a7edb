"""The README's Python snippets run as written (tiny checkpoints, CPU), so the README cannot
drift from the code."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 4, f"{len(SNIPPETS)} python snippets in README.md"


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=[f"snippet{i + 1}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs_as_written(tiny_dir, index, monkeypatch, capsys):
    assert tiny_dir == ROOT / "checkpoints" / "tiny", "the snippets name checkpoints/tiny"
    monkeypatch.chdir(ROOT)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):  # a plain process, not under torchrun
        monkeypatch.delenv(name, raising=False)
    namespace = {"__name__": f"readme_snippet_{index + 1}"}
    exec(compile(SNIPPETS[index], f"README.md snippet {index + 1}", "exec"), namespace)
    assert os.getcwd() == str(ROOT)
