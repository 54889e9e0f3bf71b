"""pyproject.toml is read by setuptools without a deprecation warning (`pip install -e .` prints none)."""

import warnings
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_pyproject_reads_without_setuptools_warnings():
    from setuptools.config.pyprojecttoml import read_configuration

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = read_configuration(ROOT / "pyproject.toml", expand=True)
    assert [str(w.message) for w in caught] == []
    assert config["project"]["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert all((ROOT / name).is_file() for name in config["project"]["license-files"])
