"""The package version (its own module: persistence stamps it without importing the package)."""

__version__ = "0.1.0"
