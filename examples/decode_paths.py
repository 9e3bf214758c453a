"""A model's decoded tokens on the compiled decoder and on the general path, side by side: what each decodes and
how far their logits are apart. Run it before and after a change to the arithmetic both paths share (such as
``formats/activations.py``), each checkout in its own process, to see that the change moved both.

    python examples/decode_paths.py MODEL.gguf [--mode dense|sparse] [--prompt TEXT] [--steps 8]

The prompt's first tokens run as one block (the general path, both times); the rest, one token at a time.
"""

from __future__ import annotations

import argparse

import numpy as np

from powerinfer_tools.runtime.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--mode", default="dense", choices=["dense", "sparse"])
    parser.add_argument("--prompt", default="The capital of France is Paris. The capital of Italy is")
    parser.add_argument("--steps", type=int, default=8, help="tokens decoded one at a time (the prompt's last)")
    args = parser.parse_args()
    llm = LLM.load(args.model, mode=args.mode, kernels="wait")
    tokens = np.array(llm.tokenizer.encode(args.prompt))
    if not 0 < args.steps < len(tokens):
        parser.error(f"--steps must be between 1 and {len(tokens) - 1}: the prompt has {len(tokens)} tokens")
    block = len(tokens) - args.steps
    logits = {}
    for compiled in (True, False):
        engine = llm.engine
        engine.compiled_decoding = compiled
        caches = engine.new_cache()
        engine.forward(tokens[:block], caches)
        logits[compiled] = np.concatenate([engine.forward(tokens[i:i + 1], caches) for i in range(block, len(tokens))])
        print(f"{engine.decode_path()}: argmax of the decoded steps {logits[compiled].argmax(axis=1).tolist()}")
    gap = np.abs(logits[True] - logits[False]) / np.abs(logits[False]).max(axis=1, keepdims=True)
    print(f"compiled decoder against the general path: |difference| / the step's largest |logit|, median "
          f"{np.median(gap):.1e}, largest {gap.max():.1e}")


if __name__ == "__main__":
    main()
