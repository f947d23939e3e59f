"""`make install` is quiet about tirl's own metadata: setuptools reads pyproject.toml without a
deprecation warning (the license as a TOML table printed a warning box three times per install)."""

from __future__ import annotations

import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setuptools_reads_the_project_metadata_without_a_warning(monkeypatch):
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)  # package discovery is relative to the project
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    ours = [str(w.message).splitlines()[0] for w in caught if "project." in str(w.message)]
    assert not ours, ours
    assert dist.metadata.license_expression == "MIT"
