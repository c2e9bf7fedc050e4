"""The suite's start order (tests/conftest.py): every file it names is a test file here, named once."""

from pathlib import Path

from tests.conftest import FIRST


def test_the_files_that_start_first_are_test_files_of_the_suite():
    tests = Path(__file__).parent
    assert len(set(FIRST)) == len(FIRST)
    missing = [name for name in FIRST if not (tests / name).is_file() or not Path(name).name.startswith("test_")]
    assert not missing, f"tests/conftest.py's FIRST names files that are not test files: {missing}"
