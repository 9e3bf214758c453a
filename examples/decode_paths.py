"""A model's decoded tokens on the compiled decoder, the general path and the NumPy reference kernels (and, with
``--llama-cpp``, llama.cpp on the same file), side by side: what each decodes, and how far apart their logits
are, and the share of FFN neurons each computed. Run it before and after a change to the arithmetic the paths
share (such as ``formats/activations.py``), each checkout in its own process, to see that the change moved them
all.

    python examples/decode_paths.py MODEL.gguf [--mode dense|sparse] [--prompt TEXT] [--steps 8] [--llama-cpp]

The prompt's first tokens run as one block; the rest, one token at a time (llama.cpp: the whole prompt in one
batch, its logits kept for every position).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from powerinfer_tools.runtime.llm import LLM

PATHS = {"compiled decoder": ("wait", True), "general path": ("wait", False), "NumPy reference": ("reference", False)}


def decoded_logits(model: str, mode: str, kernels: str, compiled: bool, text: str, steps: int):
    llm = LLM.load(model, mode=mode, kernels=kernels)
    tokens = np.array(llm.tokenizer.encode(text))
    if not 0 < steps < len(tokens):
        raise SystemExit(f"--steps must be between 1 and {len(tokens) - 1}: the prompt has {len(tokens)} tokens")
    engine = llm.engine
    engine.compiled_decoding = compiled
    caches = engine.new_cache()
    block = len(tokens) - steps
    engine.forward(tokens[:block], caches)
    active, total = engine.stats.neurons_active, engine.stats.neurons_total
    logits = np.concatenate([engine.forward(tokens[i:i + 1], caches) for i in range(block, len(tokens))])
    computed = (engine.stats.neurons_active - active) / (engine.stats.neurons_total - total)
    return tokens, logits, engine.decode_path(), computed


def llama_cpp_logits(model: str, tokens: np.ndarray, steps: int) -> np.ndarray:
    import llama_cpp

    llama = llama_cpp.Llama(model, n_ctx=max(64, len(tokens)), logits_all=True, verbose=False)
    llama.eval(tokens.tolist())
    return np.array(llama.scores[len(tokens) - steps:len(tokens)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--mode", default="dense", choices=["dense", "sparse"])
    parser.add_argument("--prompt", default="The capital of France is Paris. The capital of Italy is")
    parser.add_argument("--steps", type=int, default=8, help="tokens decoded one at a time (the prompt's last)")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp on the same file (a llama.cpp GGUF)")
    args = parser.parse_args()
    logits = {}
    for name, (kernels, compiled) in PATHS.items():
        tokens, logits[name], path, computed = decoded_logits(args.model, args.mode, kernels, compiled, args.prompt,
                                                              args.steps)
        ran = f" (ran: {path})" if compiled else ""  # where the decoder refuses the model, it says why
        print(f"{name}{ran}: argmax of the decoded steps {logits[name].argmax(axis=1).tolist()}, "
              f"{computed:.1%} of the FFN neurons computed")
    if args.llama_cpp:
        logits["llama.cpp"] = llama_cpp_logits(args.model, tokens, args.steps)
        print(f"llama.cpp: argmax of the same positions {logits['llama.cpp'].argmax(axis=1).tolist()}")
    for a, b in itertools.combinations(logits, 2):
        gap = np.abs(logits[a] - logits[b]) / np.abs(logits[b]).max(axis=1, keepdims=True)
        print(f"{a} against {b}: |difference| / the step's largest |logit|, median {np.median(gap):.1e}, "
              f"largest {gap.max():.1e}")


if __name__ == "__main__":
    main()
