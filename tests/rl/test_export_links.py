"""`tirl export` of a model directory someone shared: a symbolic link that leads outside the directory
(to a private key, say) is refused with one line and nothing is written, instead of its contents
being copied into the export; links inside the directory, and a hub cache snapshot's links into its
own blobs/, are copied as the files they name."""

from __future__ import annotations

import shutil
from pathlib import Path

from typer.testing import CliRunner

from tirl.cli import app
from tirl.rl.model_files import outside_links

SECRET = "-----BEGIN OPENSSH PRIVATE KEY----- not for export"


def _model_copy(tiny_model_dir: Path, where: Path) -> Path:
    shutil.copytree(tiny_model_dir, where)
    return where


def _export(model: Path, out: Path):
    return CliRunner().invoke(app, ["export", "--model", str(model), "--out", str(out)])


def test_a_link_to_a_file_outside_the_model_is_refused(tiny_model_dir, tmp_path):
    outside = tmp_path / "home" / "id_ed25519"
    outside.parent.mkdir()
    outside.write_text(SECRET)
    model = _model_copy(tiny_model_dir, tmp_path / "shared_model")
    (model / "tokenizer_extra.json").symlink_to(outside)
    out = tmp_path / "export"
    result = _export(model, out)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(
        f"error: model {model}: tokenizer_extra.json is a symbolic link to {outside}"
    )
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_a_linked_directory_outside_the_model_is_refused(tiny_model_dir, tmp_path):
    (tmp_path / "ssh").mkdir()
    (tmp_path / "ssh" / "id_rsa").write_text(SECRET)
    model = _model_copy(tiny_model_dir, tmp_path / "m")
    (model / "extra").symlink_to(tmp_path / "ssh", target_is_directory=True)
    assert [link.name for link, _ in outside_links(model)] == ["extra"]
    result = _export(model, tmp_path / "out")
    assert result.exit_code == 2 and "extra is a symbolic link" in result.output
    assert not any(SECRET in p.read_text() for p in (tmp_path / "out").rglob("*") if p.is_file())


def test_links_inside_the_model_and_a_hub_snapshots_blobs_are_copied(tiny_model_dir, tmp_path):
    model = _model_copy(tiny_model_dir, tmp_path / "m")
    (model / "generation_alias.json").symlink_to(model / "config.json")
    out = tmp_path / "out"
    assert _export(model, out).exit_code == 0
    copied = out / "generation_alias.json"
    assert not copied.is_symlink() and copied.read_text() == (model / "config.json").read_text()

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in tiny_model_dir.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    result = _export(snapshot, tmp_path / "from_hub")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "from_hub" / "config.json").read_text() == (tiny_model_dir / "config.json").read_text()
