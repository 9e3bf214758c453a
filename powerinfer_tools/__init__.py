"""powerinfer-tools: activation-sparse LLM inference toolkit (profile, predict, place, run)."""

__version__ = "0.1.0"
