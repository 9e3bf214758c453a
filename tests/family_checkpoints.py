"""Small random checkpoints of the families users download as llama.cpp's GGUF files, for the oracles no one
here wrote: transformers computes the checkpoint, llama.cpp's own converter (tests/llamacpp_converter.py)
writes the GGUF file and llama.cpp computes that.

Each family is built with transformers' own classes, saved in float32 and with its config.json in the form
released checkpoints have (``rope_theta`` and ``rope_scaling`` at the top, not transformers 5's
``rope_parameters``), with a tokenizer the converter accepts:

* ``bpe``: SmolLM2's byte-level BPE tokenizer (49,152 tokens), rebuilt from its GGUF file (from the package
  registry, ``real_models.fetch``) by transformers' GGUF loader. The converter knows it by its
  pre-tokenizer (``tokenizer.ggml.pre = "smollm"``). Llama and Qwen3 use it.
* ``sentencepiece``: a ``tokenizer.model`` trained here with the ``sentencepiece`` package (BPE, byte
  fallback, as Llama 2's and Phi-3's), with Phi-3's kind of added tokens after it and the vocabulary
  padded to a multiple of 64, as Phi-3's is (the converter names the padding ``[PAD{i}]``). Phi-3's and
  Gemma 2's converters read only a ``tokenizer.model``.

The weights are ``hf_models.build``'s: random, large enough that greedy continuations vary.
"""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import hf_models
import torch
import transformers
from gguf_fixtures import training_texts
from oracle_decoding import F32_ERROR

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-5)
HEAD_DIM = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
# Llama 3.1's rope_scaling. With rope_theta 500,000 and 32-wide heads, of the 16 frequencies the first 8 have
# wavelengths under 8192 / high_freq_factor (kept), the 9th is between the bounds (smoothed), the last 7 are
# beyond 8192 / low_freq_factor (divided by the factor): test_family_oracles checks that.
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
# Phi-3.5-mini's longrope, shrunk: 16 factors per list (32-wide heads), the short ones near 1, the long ones growing
# with the wavelength as Phi-3.5's do, and a trained context of 32 positions, which the oracles' prompts pass.
LONGROPE_ORIGINAL_CONTEXT = 32
LONGROPE_SCALING = dict(rope_type="longrope", short_factor=[round(1 + 0.02 * i, 4) for i in range(HEAD_DIM // 2)],
                        long_factor=[round(1.5 ** (i / 2), 4) for i in range(HEAD_DIM // 2)])
SPM_ADDED = ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>")  # Phi-3's first added tokens, in its order
GEMMA2_WINDOW = 8


@dataclass(frozen=True)
class Family:
    builder: str  # hf_models.build's family
    config: dict  # config.json as released checkpoints of the family have it (vocabulary aside)
    tokenizer: str  # "bpe" or "sentencepiece"
    architecture: str  # general.architecture of llama.cpp's converter's file
    # transformers' attention implementation for the reference (None: its default); "eager" is the only one that
    # soft-caps Gemma 2's scores
    attention: str | None = None
    embedding_std: float = 0.2  # hf_models.build's
    # Relative error of llama.cpp's logits on the f32 file against transformers' (and ours): more than F32_ERROR
    # where ggml looks GELU up in a table of fp16 values (GeGLU families)
    llamacpp_error: float = F32_ERROR


FAMILIES = {
    "llama3.1": Family("llama", dict(SHAPE, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                                     max_position_embeddings=131072), "bpe", "llama"),
    # Llama 3.2 (1B, 3B): tied embeddings, the llama3 scaling with factor 32.
    "llama3.2": Family("llama", dict(SHAPE, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING, factor=32.0),
                                     max_position_embeddings=131072, tie_word_embeddings=True), "bpe", "llama"),
    "llama-linear": Family("llama", dict(SHAPE, rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=4.0),
                                         max_position_embeddings=8192), "bpe", "llama"),
    "llama-yarn": Family("llama", dict(SHAPE, rope_theta=10000.0, max_position_embeddings=8192, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=2048)), "bpe", "llama"),
    # Qwen3: per-head RMSNorm of q and k, no biases; 0.6B-4B tie their embeddings, 8B and up do not.
    "qwen3": Family("qwen3", dict(SHAPE, head_dim=HEAD_DIM, rope_theta=1000000.0, max_position_embeddings=40960,
                                  tie_word_embeddings=False), "bpe", "qwen3"),
    "qwen3-tied": Family("qwen3", dict(SHAPE, head_dim=HEAD_DIM, rope_theta=1000000.0, max_position_embeddings=40960,
                                       tie_word_embeddings=True), "bpe", "qwen3"),
    # Phi-3-mini-4k's layout (fused qkv_proj and gate_up_proj, no longrope) with GQA as Phi-3-medium has it, and
    # its sliding_window of 2047: transformers masks beyond it, llama.cpp's phi3 ignores it (SWA "currently
    # disabled" when it loads the file), so the two compute the same on sequences of up to 2047 tokens.
    "phi3": Family("phi3", dict(SHAPE, rope_theta=10000.0, max_position_embeddings=4096,
                                original_max_position_embeddings=4096, sliding_window=2047), "sentencepiece", "phi3"),
    # Gemma 2 (llama.cpp's converter reads only a tokenizer.model): a window of 8 keys in its first layer, far
    # shorter than the prompt; caps small enough to bite (Gemma 2's are 50 and 30; test_gemma2 checks they change
    # the logits); queries scaled by 1/sqrt(head_dim), as llama.cpp's gemma2 assumes; tied embeddings (llama.cpp's
    # gemma2 has no other head) of a smaller spread, which greedy decoding needs to vary; GELU by ggml's table
    # (measured 2.0e-4).
    "gemma2": Family("gemma2", dict(SHAPE, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, rope_theta=10000.0,
                                    max_position_embeddings=8192, sliding_window=GEMMA2_WINDOW,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
                                    hidden_activation="gelu_pytorch_tanh"), "sentencepiece", "gemma2",
                     attention="eager", embedding_std=0.04, llamacpp_error=5e-4),
    # Phi-3.5-mini's (and Phi-3-mini-128k's) longrope, with its window of 262144 (none within these contexts).
    "phi3.5": Family("phi3", dict(SHAPE, rope_theta=10000.0, max_position_embeddings=1024,
                                  original_max_position_embeddings=LONGROPE_ORIGINAL_CONTEXT,
                                  rope_scaling=LONGROPE_SCALING, sliding_window=262144), "sentencepiece", "phi3"),
}


@dataclass(frozen=True)
class TokenizerFiles:
    folder: Path  # the files a checkpoint folder gets
    n_vocab: int  # the embedding's rows for it
    special_ids: dict  # config.json's bos/eos/pad_token_id


def rebuild_smollm2_tokenizer(folder: Path) -> TokenizerFiles:
    """SmolLM2's tokenizer, rebuilt by transformers from SmolLM2's GGUF file, saved into ``folder``. A package
    registry that cannot be reached is ``real_models.fetch``'s ``PitoolsError``.

    transformers' GGUF loader gives every byte-level BPE tokenizer GPT-2's pre-tokenizer, whatever the file's
    ``tokenizer.ggml.pre`` says; SmolLM2's ("smollm" in llama.cpp) first splits digits one by one, which is put
    back here (without it, " +  1" splits differently)."""
    from tokenizers import pre_tokenizers

    from powerinfer_tools.benchmarking.real_models import fetch

    gguf = fetch("smollm2", progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tokenizer.save_pretrained(folder)
    ids = {f"{kind}_token_id": tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{kind}_token"))
           for kind in ("bos", "eos", "pad")}
    return TokenizerFiles(Path(folder), len(tokenizer), ids)


def train_sentencepiece_tokenizer(folder: Path, vocab_size: int = 1000) -> TokenizerFiles:
    """A ``tokenizer.model`` as Llama 2's and Phi-3's (BPE with byte fallback, ``<unk> <s> </s>`` first, digits
    split, whitespace kept) trained on the json package's sources, with ``SPM_ADDED`` after its vocabulary and
    the embedding padded to a multiple of 64, written into ``folder`` with Phi-3's kind of tokenizer_config.json and
    transformers' tokenizer.json of it."""
    import sentencepiece

    lines = [line for text in training_texts() for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    added = {token: vocab_size + i for i, token in enumerate(SPM_ADDED)}
    (folder / "added_tokens.json").write_text(json.dumps(added))
    decoder = {str(i): {"content": t, "special": True} for i, t in enumerate(("<unk>", "<s>", "</s>"))}
    decoder.update({str(i): {"content": t, "special": True} for t, i in added.items()})
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
              "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>", "legacy": False,
              "added_tokens_decoder": decoder}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # Released Phi-3 checkpoints carry tokenizer.json too, transformers' conversion of tokenizer.model (what
    # pitools reads; llama.cpp's converter reads tokenizer.model).
    fast = folder / "fast"
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(fast)
    (fast / "tokenizer.json").replace(folder / "tokenizer.json")
    shutil.rmtree(fast)
    eos = added["<|endoftext|>"]
    n_vocab = -(-(vocab_size + len(added)) // 64) * 64
    return TokenizerFiles(folder, n_vocab, {"bos_token_id": 1, "eos_token_id": eos, "pad_token_id": eos})


@dataclass(frozen=True)
class BuiltCheckpoint:
    folder: Path
    reference: torch.nn.Module  # transformers' model read back from the folder, float32


def build_checkpoint(name: str, folder: Path, tokenizer: TokenizerFiles, seed: int = 0, **changes) -> BuiltCheckpoint:
    """Family ``name``'s checkpoint (a key of ``FAMILIES``; ``changes`` to its config) saved into ``folder`` with
    ``tokenizer``'s files, and transformers' model of it."""
    family = FAMILIES[name]
    shutil.copytree(tokenizer.folder, folder, dirs_exist_ok=True)
    config = dict(family.config, vocab_size=tokenizer.n_vocab, **tokenizer.special_ids, **changes)
    hf_models.build(folder, family.builder, seed=seed, config_overrides=config, embedding_std=family.embedding_std)
    _write_released_config(Path(folder) / "config.json")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation=family.attention).eval()
    return BuiltCheckpoint(Path(folder), reference)


def _write_released_config(path: Path) -> None:
    """config.json with transformers 5's ``rope_parameters`` written as released checkpoints have it:
    ``rope_theta``, and ``rope_scaling`` (null for the default rope), at the top."""
    config = json.loads(path.read_text())
    if "rope_parameters" not in config:  # transformers 4 writes them so
        return
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope.pop("partial_rotary_factor", None)  # Phi-3 writes 1.0: released Phi-3 configs have none
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    path.write_text(json.dumps(config, indent=2))
