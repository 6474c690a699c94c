"""Build, measurement and evaluation tools for edged (not installed with the package)."""
