"""The hybrid sparse runtime: reads GGUF weights in place and runs dense or sparse FFNs."""
