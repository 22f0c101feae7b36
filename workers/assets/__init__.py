"""Bundled assets: the tiny checkpoint and the code that builds it."""
