"""Stage 0: Hugging Face checkpoints on disk or on the hub, and their tokenizers."""
