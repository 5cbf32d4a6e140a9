"""The router: a core (admission, placement, streams) behind a gRPC and an HTTP front end,
and ``RouterClient``, the Python client of its gRPC API."""
