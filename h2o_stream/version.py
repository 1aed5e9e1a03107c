"""The package version, from the installed distribution's metadata (pyproject.toml is the one place it is written)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("h2o-stream")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
