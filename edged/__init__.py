"""edged: a streaming text-to-speech daemon for small Linux edge boxes."""

__version__ = "0.1.0"
