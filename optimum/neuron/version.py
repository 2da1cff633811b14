"""Package version."""

__version__ = "0.3.1"
