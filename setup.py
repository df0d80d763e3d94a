"""Package mapping that pyproject.toml cannot express: `operator/` is imported as
`tokenkeep_operator`, because a top-level `operator` package would shadow the standard
library module."""

from setuptools import find_packages, setup

operator_packages = ["tokenkeep_operator"] + [
    f"tokenkeep_operator.{name}" for name in find_packages("operator")
]
setup(
    packages=find_packages(include=["session_server", "session_server.*"]) + operator_packages,
    package_dir={"tokenkeep_operator": "operator"},
)
