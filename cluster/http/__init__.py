"""The HTTP edge: the OpenAI-compatible app, request validation and planning, response shapes, output
constraints and Prometheus metrics. It calls the router through the ``RouterLike`` protocol it defines
(``server_state.py``)."""
