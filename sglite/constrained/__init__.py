"""Constrained output (SGLang: srt/constrained/): a request's json_schema, regex, ebnf or
structural_tag becomes a grammar whose matcher masks the vocabulary before each token
is sampled (docs/structured_output.md)."""
