"""pdserve control plane: configs, boundary messages, router, HTTP server, client SDK (no torch here)."""
