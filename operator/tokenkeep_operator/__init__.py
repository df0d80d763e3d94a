"""tokenkeep's Kubernetes operator: ModelServer and SessionServer custom resources.

`main` runs it; `tokenkeep operator` calls it."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tokenkeep")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

from tokenkeep_operator.cli import main

__all__ = ["__version__", "main"]
