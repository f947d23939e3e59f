"""Copying a model directory without reaching outside it.

A model directory someone shared may hold a symbolic link such as `tokenizer.json -> ~/.ssh/id_rsa`:
copying it as files (`tirl export`, the files beside a merged adapter) would put that file into a
directory the user then publishes. So a link is followed only when it stays inside the directory (or,
for a Hugging Face hub cache snapshot, inside its own repository's blobs/); any other link refuses the
copy with one line naming it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _allowed_roots(root: Path) -> list[Path]:
    """The directory itself and, for a hub cache snapshot (models--org--name/snapshots/<rev>), its blobs/."""
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent / "blobs")
    return roots


def outside_links(directory: str | Path) -> list[tuple[Path, Path]]:
    """(link, where it points) for every symbolic link under `directory` that leads outside it."""
    root = Path(directory).resolve()
    roots = _allowed_roots(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                continue
            target = path.resolve()
            if not any(target == r or target.is_relative_to(r) for r in roots):
                found.append((path, target))
    return sorted(found)


def outside_link_message(directory: str | Path, found: list[tuple[Path, Path]], outside: str) -> str:
    """The first of `outside_links`' finds in words: "<link> is a symbolic link to <target>, outside ..."."""
    link, target = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"{link.relative_to(Path(directory).resolve())} is a symbolic link to {target}, outside {outside}{more}"


def check_links(directory: str | Path, what: str) -> None:
    """Refuse (ValueError, one line) a directory holding a link that points outside it."""
    bad = outside_links(directory)
    if bad:
        raise ValueError(
            f"{what} {directory}: {outside_link_message(directory, bad, 'the directory')}: only what the "
            "directory holds is copied; replace the link by the file it should be, or remove it"
        )


def copy_model_dir(source: str | Path, dest: str | Path) -> None:
    """Copy a model directory's files (links inside it as the files they name) after `check_links`."""
    check_links(source, "model")
    shutil.copytree(source, dest, dirs_exist_ok=True)
