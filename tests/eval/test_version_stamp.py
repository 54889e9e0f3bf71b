"""Results are stamped with the source's version, which the runner's reuse key compares."""

import importlib.metadata
from pathlib import Path

import hf_kvcompress
from hf_kvcompress.eval import runner


def test_the_stamp_is_the_sources_version_not_the_install_metadata(monkeypatch):
    # An editable install made before a version bump keeps reporting the old version in its metadata.
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1")
    assert runner.package_version() == hf_kvcompress.__version__ != "0.0.1"


def test_the_package_metadata_reads_the_same_version():
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "hf_kvcompress.__version__" }' in pyproject
