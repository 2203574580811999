"""LayerZero's version (re-exported as ``layerzero.__version__``; matches ``version`` in pyproject.toml)."""

__version__ = "0.1.0"
