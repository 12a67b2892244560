"""Fixtures shared by several test modules."""

import json
import sqlite3
import sysconfig
from pathlib import Path

import lightning  # noqa: F401  (see below)
import pytest

# Lightning adds a StreamHandler bound to the sys.stderr of the moment it is first imported. Imported
# here, at collection, that is the session's stream; first imported inside a test that captures
# output (capsys), it would be that test's stream, closed afterwards, and every later Lightning log
# line ("Seed set to ...") would print a "--- Logging error ---" traceback into other tests' output.


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run first (else in file order): with -n, the other worker takes the many
    short tests meanwhile and both finish together, instead of one worker running a minutes-long
    sweep at the end while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Modules whose tests share expensive module fixtures (test_tracking: an MLflow server, and a sweep
# through it that two tests compare against): with -n, each runs on one worker, which builds them once.
ONE_WORKER_MODULES = ("tests/test_tracking.py",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n's default scheduling (--dist load: each test goes to whichever worker is free), except that
    a module of ONE_WORKER_MODULES is handed out whole, and first (xdist's scope scheduling starts
    with the largest units). --dist loadgroup would do it with marks, but does not group under
    pytest >= 9.2 (pytest-dev/pytest-xdist#1386)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LoadWithWholeModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return LoadWithWholeModules(config, log)


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri_isolated():
    """A test that fits in-process through LitMharCLI (not ``main``) sets MLflow's process-wide tracking
    URI, and with it ``MLFLOW_TRACKING_URI``: later tests on the same worker would log into its store."""
    from lit_mhar.cli import tracking_uri_restored

    with tracking_uri_restored():
        yield


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


@pytest.fixture(scope="session", autouse=True)
def mlflow_schema_built_once(tmp_path_factory):
    """Every new sqlite MLflow store in this process gets its tables copied from one built once per session.

    MLflow builds a new store by running all of its schema migrations: ~3 s on two cores, for each
    of the many fits here that log to a fresh ``mlflow.db``. The copy (sqlite's backup API) is the
    same database those migrations produce; the store then goes on as usual (default experiment,
    schema check). Subprocesses (CLI commands, sweep trials) still migrate for real.
    """
    import mlflow.store.db.utils as db_utils
    import sqlalchemy

    migrate = db_utils._initialize_tables
    template: list[Path] = []

    def initialize_tables(engine) -> None:
        if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
            return migrate(engine)
        if not template:
            path = tmp_path_factory.mktemp("mlflow-schema") / "mlflow.db"
            built = sqlalchemy.create_engine(f"sqlite:///{path}")
            migrate(built)
            built.dispose()
            template.append(path)
        raw = engine.raw_connection()
        source = sqlite3.connect(template[0])
        try:
            source.backup(raw.driver_connection)
        finally:
            source.close()
            raw.close()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(db_utils, "_initialize_tables", initialize_tables)
        yield
