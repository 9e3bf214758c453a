"""The small trained LLaMAs that ship with the project, so every command works offline.

``BUNDLED_MODEL`` is the ReLU (ReGLU) one, trained to fire sparsely: every command's default model.
``BUNDLED_SILU_MODEL`` is its dense SwiGLU (SiLU) twin, with the same recipe, tokenizer and held-out
text, but no sparsity penalty: the model that training-free activation sparsity (CATS, TEAL) is measured on.
"""

from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "examples" / "tiny-relu-llama"
BUNDLED_SILU_MODEL = Path(__file__).resolve().parent.parent / "examples" / "tiny-silu-llama"
