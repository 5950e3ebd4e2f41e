"""onegraph: Qwen3.5/3.6 hybrid LLM traced into static graphs, lowered once, replayed thinly."""
__version__ = "0.1.0"
