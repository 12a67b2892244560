"""The README's commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command_lines(path: Path) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")}


def test_ci_installs_and_tests_exactly_as_the_readme_says():
    readme, ci = command_lines(ROOT / "README.md"), command_lines(ROOT / ".ci" / "run")
    install = [line for line in ci if line.startswith("pip install")]
    tests = [line for line in ci if line.startswith("python -m pytest")]
    assert install and tests, "CI must install and run the tests"
    for line in install + tests:
        assert line in readme, f"CI runs {line!r}, which the README does not say"
