"""The repository's promises to a newcomer: CI runs the README's test command, and the quickstart is what it says."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_opens_with_train_and_test_commands():
    train, test = readme_commands()[:2]
    assert "pip install torch==2.13.0" in train and train.endswith("./run_llama_train.sh")
    assert "pip install" in test and "pytest" in test


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
