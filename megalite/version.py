"""The package version, at the bottom of the layers so that any module may record it (checkpoints do)."""

__version__ = "0.1.0"
