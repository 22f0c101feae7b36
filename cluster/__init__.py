"""pdserve control plane: configs, boundary messages, router, HTTP server, client SDK (no torch here)."""

__version__ = "0.1.0"  # the package version (setup.cfg reads it)
