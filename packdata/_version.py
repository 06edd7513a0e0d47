"""The package version, in its own module so that any module may import it."""

__version__ = "0.1.0"
