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


def test_overwrite_never_deletes_files_the_command_did_not_write(tmp_path):
    from lit_mhar.outputs import check_output_dir

    out = tmp_path / "out"
    check_output_dir(out, False, ["model.ckpt"], "convert")  # absent: fine
    out.mkdir()
    check_output_dir(out, False, ["model.ckpt"], "convert")  # empty: fine
    (out / "model.ckpt").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite true"):
        check_output_dir(out, False, ["model.ckpt"], "convert")
    check_output_dir(out, True, ["model.ckpt"], "convert")  # only ours: may be replaced
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"convert did not write \(\['notes.txt'\]\)"):
        check_output_dir(out, True, ["model.ckpt"], "convert")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="not a directory"):
        check_output_dir(tmp_path / "file", True, [], "probe")
