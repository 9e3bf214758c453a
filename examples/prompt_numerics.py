"""How far a prompt's logits on the compiled kernels are from the NumPy reference's on the same file: the
numerics of the kernels (ggml's q8_0 rounding of the GEMMs' input, bfloat16 products of ``ffn_down_t``), without
the noise of a perplexity over a few tokens.

    python examples/prompt_numerics.py MODEL.gguf [--mode dense|sparse] [--tokens 128]

Prints, over the prompt's positions, the median and largest relative distance ||compiled - reference|| /
||reference|| of the logits, and how often their top-1 tokens agree. Run it with ``PYTHONPATH`` set to another
checkout to compare two versions of the kernels.
"""

from __future__ import annotations

import argparse

import numpy as np

from powerinfer_tools import kernels
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.loader import load_runtime_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--mode", default="sparse", choices=["dense", "sparse"])
    parser.add_argument("--tokens", type=int, default=128, help="the prompt's length (random token ids)")
    args = parser.parse_args()
    model = load_runtime_model(args.model)
    model.mode = FFNMode(args.mode)
    ids = np.random.default_rng(0).integers(100, 20000, args.tokens)

    def logits(reason: str | None) -> np.ndarray:
        kernels.use_reference(reason)
        try:
            return model.forward(ids, model.new_cache(), all_logits=True)
        finally:
            kernels.use_reference(None)

    reference, compiled = logits("examples/prompt_numerics.py"), logits(None)
    distance = np.linalg.norm(compiled - reference, axis=1) / np.linalg.norm(reference, axis=1)
    agree = (compiled.argmax(axis=1) == reference.argmax(axis=1)).mean()
    print(f"{args.model} ({args.mode}, {args.tokens}-token prompt): logits' relative distance from the reference "
          f"median {np.median(distance):.4f}, largest {distance.max():.4f}; top-1 agreement {agree:.1%}")


if __name__ == "__main__":
    main()
