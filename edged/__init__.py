"""edged: a streaming text-to-speech daemon for small Linux edge boxes."""

import os

__version__ = "0.1.0"

# onnxruntime's PyPI build writes a device id and a telemetry store (~/.cache/Microsoft/...) when
# it is imported, and takes ~15 ms longer to: neither belongs on an edge box. Set before anything
# of edged imports onnxruntime; a deployment that wants it sets ORT_DISABLE_TELEMETRY=0.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
