"""Fixtures shared by several test modules."""

import json
import sysconfig
from pathlib import Path

import lightning  # noqa: F401  (see below)
import pytest

# Lightning adds a StreamHandler bound to the sys.stderr of the moment it is first imported. Imported
# here, at collection, that is the session's stream; first imported inside a test that captures
# output (capsys), it would be that test's stream, closed afterwards, and every later Lightning log
# line ("Seed set to ...") would print a "--- Logging error ---" traceback into other tests' output.


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory) -> Path:
    """A tiny dataset of 12 real stdlib modules (BPE vocabulary 300, 30% validation), prepared once per session."""
    from lit_mhar.data import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / name) for name in ("textwrap.py", "shlex.py", "colorsys.py", "bisect.py", "heapq.py", "fnmatch.py",
                                             "glob.py", "string.py", "keyword.py", "struct.py", "copy.py", "abc.py")]
    out = tmp_path_factory.mktemp("corpus") / "data"
    prepare(output_dir=str(out), source="files", files=files, vocab_size=300, val_fraction=0.3, chunk_bytes="64KB")
    return out


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A tiny dataset of 10 real stdlib modules (BPE vocabulary 400), prepared once through the CLI."""
    from lit_mhar.cli import main

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / "json" / name) for name in ("__init__.py", "decoder.py", "encoder.py", "scanner.py", "tool.py")]
    files += [str(stdlib / name) for name in ("textwrap.py", "shlex.py", "colorsys.py", "bisect.py", "heapq.py")]
    out = tmp_path_factory.mktemp("corpus") / "data"
    args = ["prepare", "--output_dir", str(out), "--source", "files", "--vocab_size", "400", "--val_fraction", "0.3", "--chunk_bytes", "64KB", "--files", json.dumps(files)]
    assert main(args) == 0
    assert (out / "manifest.json").is_file()
    return out
