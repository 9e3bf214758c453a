"""The small trained ReLU LLaMA that ships with the project, so every command works offline."""

from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "examples" / "tiny-relu-llama"
