"""How the code is laid out: formatted and linted, import without side effects, library code that
raises instead of exiting, scripts that need no sys.path edits."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_MODULES = ("qwen3_flex_inference.py", "gemma4_flex_inference.py")


def run_ruff(*args) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed (requirements.txt lists it)"
    return subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)


def test_every_file_is_formatted_and_lint_clean_at_the_configured_width():
    formatted = run_ruff("format", "--check", ".")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    linted = run_ruff("check", ".")
    assert linted.returncode == 0, linted.stdout + linted.stderr


IMPORT_PROBE = """
import json, os, sys
import torch, torch._dynamo, torch._inductor.config, triton, transformers  # their own imports may read anything
from torch._dynamo import config as dynamo_config

ENGINE_FILES = {"qwen3_flex_inference.py", "gemma4_flex_inference.py"}
reads = []

class RecordingEnviron(dict):
    def _record(self, key):
        caller = sys._getframe(2).f_code.co_filename
        if os.path.basename(caller) in ENGINE_FILES:
            reads.append(f"{os.path.basename(caller)}: {key}")
    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)
    def get(self, key, default=None):
        self._record(key)
        return super().get(key, default)
    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)

def configs():
    return [repr(sorted(config.get_config_copy().items())) for config in (dynamo_config, torch._inductor.config)]

before = configs()
os.environ = RecordingEnviron(os.environ)
import qwen3_flex_inference, gemma4_flex_inference
after = configs()
changed = {"dynamo_config_changed": before[0] != after[0], "inductor_config_changed": before[1] != after[1]}
print(json.dumps({"reads": reads, **changed}))
"""


def test_importing_the_engine_modules_changes_no_compile_config_and_reads_no_environment():
    run = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"reads": [], "dynamo_config_changed": False, "inductor_config_changed": False}, f"{result=}"


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_system_exit_is_raised_only_in_main_and_run_cli(module):
    tree = ast.parse((ROOT / module).read_text())
    exits = []
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Raise) and "SystemExit" in ast.unparse(node.exc or ast.Constant(None)):
                    exits.append(function.name)
    assert exits and set(exits) <= {"main", "run_cli"}, f"SystemExit raised in {sorted(set(exits))}"


def test_no_script_or_test_edits_sys_path():
    files = [*ROOT.glob("scripts/**/*.py"), *ROOT.glob("tests/*.py"), *(ROOT / m for m in ENGINE_MODULES)]
    edits = [str(path.relative_to(ROOT)) for path in files if "sys.path." + "insert" in path.read_text()]
    assert not edits, f"{edits=}"
