"""A killed command takes its child processes along, and the next run cleans up what it left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def trials(pid: int) -> list[int]:
    """The sweep trial processes among ``pid``'s children."""
    found = []
    for child in children(pid):
        try:
            if b"lit_mhar.sweeps.trial" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")


@pytest.mark.slow
def test_a_killed_prepare_takes_its_workers_along_and_the_next_one_removes_its_staging_folder(small_corpus, tmp_path):
    """kill -9 on prepare left its litdata workers running and a .tmp-* folder beside the dataset."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(stdlib.glob("*.py"))[:60]
    for copy in range(12):  # ~30 MB of text: seconds of tokenising (each copy distinct: prepare drops exact duplicates)
        for source in sources:
            (corpus / f"{copy}-{source.name}").write_bytes(f"# copy {copy}\n".encode() + source.read_bytes())
    out = tmp_path / "data"
    command = [sys.executable, "-m", "lit_mhar.cli", "prepare", "--output_dir", str(out), "--source", "files", "--files", json.dumps([f"{corpus}/*.py"]),
               "--tokenizer", str(small_corpus / "tokenizer.json"), "--num_workers", "2", "--chunk_bytes", "64KB"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # the tokenising workers, which write into the staging folder (the scan's workers come before it exists)
    wait_for(lambda: (len(children(proc.pid)) >= 2 and any(tmp_path.glob(".data.tmp-*"))) or proc.poll() is not None, 120,
             "prepare's workers")
    workers = children(proc.pid)
    assert proc.poll() is None and len(workers) >= 2, proc.communicate()[1][-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not any(alive(w) for w in workers), 10, "the workers to die with prepare")
    (staging,) = tmp_path.glob(".data.tmp-*")
    assert not out.exists()

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"[lit-mhar] removed {staging}: the unfinished folder of an earlier run into {out} that was killed" in again.stderr
    assert not list(tmp_path.glob(".data.tmp-*")) and (out / "manifest.json").is_file()


@pytest.mark.slow
def test_a_killed_sweep_takes_its_trial_along_and_the_next_run_closes_it(stdlib_corpus, tmp_path):
    """kill -9 on `sweep run` while a trial started left the trial training to its end, its result thrown away."""
    sweep = yaml.safe_load((ROOT / "sweeps" / "debug.yaml").read_text())
    sweep.update(study="killed", space=[{"residual": ["prenorm"]}], objective={"tokens": 2048, "evals": 2},
                 storage=f"sqlite:///{tmp_path / 'sweeps.db'}", output_dir=str(tmp_path / "runs"),
                 mlflow={"experiment": "sweeps-test", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})  # fmt: skip
    sweep["base"]["model"]["config"].update(d_model=32, n_layer=1, n_head=2, n_kv_head=1, ffn_dim=64)
    sweep["base"]["data"].update(data_dir=str(stdlib_corpus), seq_len=32, batch_size=4)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    runner = subprocess.Popen([sys.executable, "-m", "lit_mhar.cli", "sweep", "run", "--config", str(path)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wait_for(lambda: trials(runner.pid) or runner.poll() is not None, 180, "the trial process")
    (trial,) = trials(runner.pid)
    os.kill(runner.pid, signal.SIGKILL)  # while the trial starts up (imports alone take it longer than 5 s)
    runner.wait()
    wait_for(lambda: not alive(trial), 5, "the trial to die with the runner")

    again = subprocess.run([sys.executable, "-m", "lit_mhar.cli", "sweep", "run", "--config", str(path)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"trial 0 was left RUNNING by worker {runner.pid}, which is gone: marked FAIL (interrupted)" in again.stdout + again.stderr
    import optuna

    states = [t.state.name for t in optuna.load_study(study_name="killed", storage=f"sqlite:///{tmp_path / 'sweeps.db'}").trials]
    assert states == ["FAIL", "COMPLETE"]
