"""Serving: the HTTP server and its processes (``sglite serve``)."""
