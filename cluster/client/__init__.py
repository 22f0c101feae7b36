"""The pdserve SDK: ``from cluster.client import Client, AsyncClient`` (httpx only; no torch, no ray).

``sdk.py`` holds the clients, ``types.py`` the openai-shaped results, stream deltas and typed errors."""

from cluster.client.sdk import *  # noqa: F403  (the SDK's public names, as listed in sdk.__all__)
from cluster.client.sdk import __all__ as __all__
