"""The one thing ``pyproject.toml`` cannot say: the plugin's packages are found in ``fixtures/``
(the project's layout) and installed under ``keras_dtensor_conformance``, so a new sub-package of
``fixtures/`` installs without a list to update. Everything else is in ``pyproject.toml``."""

from setuptools import find_packages, setup

PACKAGE = "keras_dtensor_conformance"

setup(packages=[PACKAGE, *(f"{PACKAGE}.{name}" for name in find_packages("fixtures"))])
