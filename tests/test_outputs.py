"""Output folders appear complete or not at all."""

import pytest

from lit_mhar.outputs import staged_directory


def test_a_failure_inside_keeps_the_existing_folder_and_leaves_no_staging_folder(tmp_path):
    out = tmp_path / "dataset"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with staged_directory(out) as tmp:
            (tmp / "new").write_text("new")
            raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["dataset"]
    assert (out / "keep").read_text() == "old" and not (out / "new").exists()


def test_success_replaces_the_folder_only_after_the_check_passes(tmp_path):
    out = tmp_path / "dataset"
    out.mkdir()
    (out / "keep").write_text("old")

    def refuse():
        raise FileExistsError("not ours")

    with pytest.raises(FileExistsError):
        with staged_directory(out, before_replace=refuse) as tmp:
            (tmp / "new").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["keep"]
    with staged_directory(out) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["dataset"]
    assert sorted(p.name for p in out.iterdir()) == ["new"]
