"""sglite's benchmarks: side-by-side runs against Hugging Face ``transformers``
(``sglite bench``, ``python benchmarks/bench.py``) and the single-purpose scripts
(``load_time.py``, ``tracing_overhead.py``, ``tui_overhead.py``). Results are
written under ``benchmarks/results/``; docs/benchmarks.md explains every number."""
