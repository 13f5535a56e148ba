"""The package version: the installed distribution's, else the source tree's."""

from __future__ import annotations

from importlib import metadata

__all__ = ["VERSION", "version"]

#: The one place the version is written: pyproject.toml reads it from here.
VERSION = "0.1.0"


def version() -> str:
    """The installed ``graphrunner`` distribution's version; :data:`VERSION`
    when the package runs from a source tree that was never installed."""
    try:
        return metadata.version("graphrunner")
    except metadata.PackageNotFoundError:
        return VERSION
