"""1-bit compressed communication and 1-bit Adam for zkit."""

__version__ = "0.1.0"
