"""realtime: streaming speech and media inference."""
__version__ = "0.1.0"
