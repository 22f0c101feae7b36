"""The router: worker membership, request flights, the request path, route choice, placement, admission
and run-time predictions. It imports the vocabulary at ``cluster/``'s root and nothing of ``cluster.http``
or ``cluster.client``."""
