"""The package version, written into every commit marker."""

__version__ = "0.1.0"
