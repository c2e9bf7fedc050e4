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


def test_the_set_up_line_installs_what_the_readme_commands_use():
    """An optimizer with quantized state needs torchao (the ``lowbit`` extra): a README command that names one is
    covered by the train command's install."""
    from torchtitan.optim.builder import OPTIMIZERS
    from torchtitan.optim.settings import BLOCK_SIZE

    quantized = {name for name, kind in OPTIMIZERS.items() if BLOCK_SIZE in kind.options}
    commands = readme_commands()
    named = {name for command in commands for name in quantized if re.search(rf"\b{name}\b", command)}
    assert not named or "-e '.[lowbit]'" in commands[0], named
