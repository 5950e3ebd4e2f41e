"""Measurement scripts (not installed): run from a checkout as `python -m onegraph.scripts.NAME`. No module of
the package imports them; each writes a JSON under benchmarks/ that records its command."""
