"""gemcore: fast training of recommendation foundation models on jagged user histories."""
__version__ = "0.1.0"
