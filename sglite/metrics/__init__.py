"""Prometheus metrics with SGLang's names (``sglite serve --enable-metrics``)."""
