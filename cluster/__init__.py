"""pdserve control plane (no torch here). The root holds the vocabulary every layer shares (configs, boundary
messages, the wire codec and its frames, block hashes, the tokenizer, cost profiles); `router/`, `http/`
and `client/` are the control plane's parts."""

__version__ = "0.1.0"  # the package version (setup.cfg reads it)
