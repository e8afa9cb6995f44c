"""The package version: read by ``pyproject.toml`` (scikit-build-core's regex provider) and by the kernel cache."""

__version__ = "0.1.0"
"""This release of jax-dqpost (its kernel cache entries are keyed by it)."""

