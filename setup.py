"""Package layout that pyproject.toml cannot express: the repository's ``configs/`` folder ships as
package data ``megahash/configs`` (found by :mod:`megahash.config_files`), so a wheel or ``pip install .``
runs ``megahash params --config 500m`` from any directory. Only ``megahash`` is installed: the
``data_tools/`` and ``launch/`` entry scripts are run from the repository."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["megahash", "megahash.*"]) + ["megahash.configs"],
    package_dir={"megahash.configs": "configs"},
    package_data={"megahash.configs": ["*.yaml", "*/*.yaml", "*/*.json"]},
)
