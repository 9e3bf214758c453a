"""`pitools convert` / `pitools inspect`: names, layouts, types and values of what is written.

Expected values are computed here from the checkpoint, independently of the converter:
q and k rows regrouped for llama.cpp's rope, down projections transposed in the
PowerInfer layout, and every quantized tensor equal bit for bit to gguf's reference
quantizer applied to the float32 weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import powerinfer_tools.formats.model_file as model_file
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize, quantize
from gguf_fixtures import make_model, random_predictors, rope_rows, save_predictors
from powerinfer_tools.formats.model_file import open_model_file

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.errors import PitoolsError

OUTTYPES = ["f32", "f16", "q8_0", "q4_0"]
# intermediate_size 80: the dense ffn_down rows (80 wide) are no whole number of 32-blocks.
RELU_LLAMA = dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, hidden_act="relu", tie_word_embeddings=True)
PREDICTOR_HIDDEN = 16
BUNDLED = Path(__file__).resolve().parents[1] / "examples" / "tiny-relu-llama"


@pytest.fixture(scope="module")
def relu_llama(tmp_path_factory):
    """A ReGLU LLaMA (GQA, tied embeddings) and a predictor folder for it."""
    root = tmp_path_factory.mktemp("relu")
    make_model(root / "relu-llama", "llama", **RELU_LLAMA)
    layers = random_predictors(2, 64, 80, PREDICTOR_HIDDEN)
    save_predictors(root / "predictors", layers, sparse_threshold=0.25)
    return root / "relu-llama", root / "predictors"


def expected_llama(folder: Path, powerinfer: bool, predictors: Path | None = None) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values, for a LLaMA-family checkpoint."""
    ck = Checkpoint(folder)
    cfg = ck.config
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    get = ck.tensor
    out = {
        "token_embd.weight": get("model.embed_tokens.weight"),
        "output_norm.weight": get("model.norm.weight"),
        "output.weight": get("model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"),
    }
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight")
        down = get(p + "mlp.down_proj.weight")
        out |= {
            b + "attn_norm.weight": get(p + "input_layernorm.weight"),
            b + "attn_q.weight": q[rope_rows(len(q), heads)],
            b + "attn_k.weight": k[rope_rows(len(k), kv_heads)],
            b + "attn_v.weight": get(p + "self_attn.v_proj.weight"),
            b + "attn_output.weight": get(p + "self_attn.o_proj.weight"),
            b + "ffn_norm.weight": get(p + "post_attention_layernorm.weight"),
            b + "ffn_gate.weight": get(p + "mlp.gate_proj.weight"),
            b + "ffn_up.weight": get(p + "mlp.up_proj.weight"),
            (b + "ffn_down_t.weight" if powerinfer else b + "ffn_down.weight"): down.T if powerinfer else down,
        }
    if predictors is not None:
        from safetensors.numpy import load_file

        out |= load_file(str(predictors / "predictors.safetensors"))
    return {name: np.ascontiguousarray(v, dtype=np.float32) for name, v in out.items()}


def assert_stored(name: str, qtype: T, data: np.ndarray, expected: np.ndarray) -> None:
    """Stored data equals what gguf's reference code makes of the expected float32 values."""
    if qtype is T.F32:
        assert np.array_equal(data, expected), name
    elif qtype is T.F16:
        assert np.array_equal(data, expected.astype(np.float16)), name
    else:
        reference = quantize(expected, qtype)
        assert np.array_equal(data, reference), name
        assert np.array_equal(dequantize(data, qtype), dequantize(reference, qtype)), name


def expected_type(name: str, outtype: str, shape: tuple[int, ...]) -> T:
    """llama.cpp's rules, spelled out for the tensors of these test models."""
    if len(shape) == 1 or name.endswith("_norm.weight") or name.startswith("position_embd"):
        return T.F32
    wanted = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[outtype]
    if name.endswith((".fc1.weight", ".fc2.weight")) and outtype == "f16":
        wanted = T.Q8_0  # predictors: q8_0 in an f16 file (formats/quantization.py, PREDICTOR_TYPES)
    if name.endswith(".fc2.weight") and outtype == "q4_0":
        wanted = T.Q8_0  # and fc2 q8_0 in a q4_0 file
    if wanted not in (T.F32, T.F16) and shape[-1] % 32:
        return T.F16
    return T.Q8_0 if wanted is T.Q4_0 and name == "output.weight" else wanted


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_powerinfer_layout_round_trip(tmp_path, relu_llama, outtype):
    folder, predictors = relu_llama
    path, plan = convert(str(folder), tmp_path / "m.gguf", outtype=outtype, predictors=predictors, progress=False)
    assert path.read_bytes()[:4] == b"PWRI" and plan.powerinfer
    with pytest.raises(ValueError):
        GGUFReader(path)  # plain gguf-py refuses PowerInfer's magic ...
    model = open_model_file(path)  # ... ours accepts it
    assert model.powerinfer and model.version == 3 and model.architecture == "llama"
    expected = expected_llama(folder, powerinfer=True, predictors=predictors)
    assert list(model.tensors) == list(plan_names(plan))
    assert set(model.tensors) == set(expected)
    for name, t in model.tensors.items():
        assert t.shape == expected[name].shape, name
        assert t.qtype is expected_type(name, outtype, t.shape), name
        assert not t.data.flags.owndata and not t.data.flags.writeable, name  # a view into the mapped file
        assert_stored(name, t.qtype, t.data, expected[name])
    assert model.get("powerinfer.sparse_threshold") == 0.25
    assert model.get("{arch}.block_count") == 2 and model.get("pitools.ffn_activation") == "reglu"
    assert model.get("general.file_type") == {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}[outtype]


def test_the_predictors_training_quality_goes_into_the_file(relu_llama, tmp_path):
    folder, predictors = relu_llama
    path, _ = convert(str(folder), tmp_path / "m.gguf", predictors=predictors, progress=False)
    layers = json.loads((predictors / "predictors.json").read_text())["layers"]
    model = open_model_file(path)
    for key, field in [("recall", "recall"), ("precision", "precision"), ("computed", "predicted_density")]:
        assert list(model.get(f"pitools.predictor.{key}")) == pytest.approx([e[field] for e in layers]), key
    report = json.loads(CliRunner().invoke(cli, ["inspect", str(path), "--json"]).stdout)
    assert report["predictor_quality"]["worst_recall"] == pytest.approx(min(e["recall"] for e in layers))
    text = CliRunner().invoke(cli, ["inspect", str(path)]).stdout
    assert f"trained to recall >= {min(e['recall'] for e in layers):.1%}" in text
    dense = CliRunner().invoke(cli, ["inspect", str(convert(str(folder), tmp_path / "d.gguf", dense=True,
                                                            progress=False)[0]), "--json"]).stdout
    assert json.loads(dense)["predictor_quality"] is None


def plan_names(plan):
    return [t.name for t in plan.tensors]


@pytest.mark.parametrize("outtype", ["f16", "q4_0"])
def test_dense_layout_is_plain_gguf(tmp_path, relu_llama, outtype):
    folder, _ = relu_llama
    path, plan = convert(str(folder), tmp_path / "m.gguf", outtype=outtype, dense=True, progress=False)
    assert path.read_bytes()[:4] == b"GGUF" and not plan.powerinfer
    reader = GGUFReader(path)  # gguf-py's own reader
    expected = expected_llama(folder, powerinfer=False)
    assert {t.name for t in reader.tensors} == set(expected)
    for t in reader.tensors:
        assert_stored(t.name, T(t.tensor_type), np.asarray(t.data), expected[t.name])
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.attention.head_count_kv"] == 2 and fields["llama.rope.dimension_count"] == 16
    assert fields["pitools.ffn_activation"] == "reglu"
    assert "powerinfer.sparse_threshold" not in fields


def test_chunked_writing_is_exact(tmp_path, relu_llama, monkeypatch):
    """Tensors are produced a few rows at a time; the file must not depend on the chunk size."""
    folder, predictors = relu_llama
    whole, _ = convert(str(folder), tmp_path / "whole.gguf", outtype="q8_0", predictors=predictors, progress=False)
    monkeypatch.setattr(model_file, "_CHUNK_BYTES", 3 * 64 * 4)  # 3 rows of 64 floats
    chunked, _ = convert(str(folder), tmp_path / "chunked.gguf", outtype="q8_0", predictors=predictors, progress=False)
    assert whole.read_bytes() == chunked.read_bytes()


def test_bamboo_and_drelu_names(tmp_path):
    config = dict(RELU_LLAMA, tie_word_embeddings=False, sliding_window=None)
    make_model(tmp_path / "bamboo", "mistral", build_kwargs=dict(drelu=True, saved_model_type="bamboo"), **config)
    sparse = open_model_file(convert(str(tmp_path / "bamboo"), tmp_path / "b.gguf", progress=False)[0])
    assert sparse.architecture == "bamboo" and sparse.powerinfer
    assert sparse.get("bamboo.attention.layer_norm_rms_epsilon") is not None
    assert sparse.get("pitools.ffn_activation") == "drelu"
    dense = open_model_file(convert(str(tmp_path / "bamboo"), tmp_path / "d.gguf", dense=True, progress=False)[0])
    assert dense.architecture == "llama" and not dense.powerinfer  # llama.cpp has no dReLU: it runs SiLU
    expected = expected_llama(tmp_path / "bamboo", powerinfer=False)
    for name, t in dense.tensors.items():
        assert_stored(name, t.qtype, t.data, expected[name])


OPT = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
           word_embed_proj_dim=64, pad_token_id=1)


def test_opt_layout(tmp_path):
    make_model(tmp_path / "opt", "opt", **OPT)
    path, _ = convert(str(tmp_path / "opt"), tmp_path / "o.gguf", outtype="q4_0", progress=False)
    model = open_model_file(path)
    assert model.architecture == "opt" and model.powerinfer
    ck = Checkpoint(tmp_path / "opt")
    d = "model.decoder."
    assert "output.weight" not in model  # OPT computes logits with token_embd
    assert model["token_embd.weight"].qtype is T.Q8_0  # ... so it gets the output's q8_0
    assert model["position_embd.weight"].qtype is T.F32
    assert_stored("position_embd", T.F32, model["position_embd.weight"].data, ck.tensor(d + "embed_positions.weight"))
    fc2 = ck.tensor(d + "layers.1.fc2.weight")
    assert_stored("down_t", T.Q4_0, model["blk.1.ffn_down_t.weight"].data, np.ascontiguousarray(fc2.T))
    assert_stored("down_t bias", T.F32, model["blk.1.ffn_down_t.bias"].data, ck.tensor(d + "layers.1.fc2.bias"))
    assert_stored("q", T.Q4_0, model["blk.0.attn_q.weight"].data, ck.tensor(d + "layers.0.self_attn.q_proj.weight"))
    assert model.get("opt.attention.layer_norm_epsilon") == pytest.approx(1e-5)


def test_opt_350m_style_is_refused(tmp_path):
    make_model(tmp_path / "opt", "opt", **dict(OPT, word_embed_proj_dim=32, do_layer_norm_before=False))
    with pytest.raises(PitoolsError, match="OPT-350m"):
        convert(str(tmp_path / "opt"), tmp_path / "o.gguf", progress=False)


def test_silu_models_are_dense_and_take_no_predictors(tmp_path, relu_llama):
    folder = tmp_path / "silu"
    make_model(folder, "llama", **dict(RELU_LLAMA, hidden_act="silu"))
    path, plan = convert(str(folder), progress=False)
    assert path == tmp_path / "silu.gguf" and not plan.powerinfer  # default name, beside the folder
    with pytest.raises(PitoolsError, match="not activation-sparse"):
        convert(str(folder), tmp_path / "x.gguf", predictors=relu_llama[1], progress=False)
    with pytest.raises(PitoolsError, match="with --dense"):
        convert(str(relu_llama[0]), tmp_path / "y.gguf", dense=True, predictors=relu_llama[1], progress=False)


@pytest.mark.parametrize("family, config, dense, noted", [
    ("llama", RELU_LLAMA, True, "not with this model's ReLU (reglu)"),
    ("mistral", dict(RELU_LLAMA, sliding_window=None), True, "not with this model's ReLU (drelu)"),  # dReLU
    ("llama", dict(RELU_LLAMA, hidden_act="silu"), True, None),
    ("llama", RELU_LLAMA, False, None),  # the PowerInfer layout: llama.cpp does not load it
    ("opt", OPT, True, None),  # mainline llama.cpp has no OPT; PowerInfer's computes its ReLU
])
def test_convert_notes_where_llamacpp_computes_another_ffn(tmp_path, family, config, dense, noted):
    """llama.cpp's dense "llama" computes SiLU whatever the model's activation (tests/test_llamacpp_dense.py)."""
    make_model(tmp_path / "model", family, build_kwargs=dict(drelu=True) if family == "mistral" else None, **config)
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "model"), "-o", str(tmp_path / "m.gguf")]
                                + (["--dense"] if dense else ["--no-sparsity"]))
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "llama.cpp computes" in line]
    assert len(notes) == (noted is not None) and all("with SiLU (swiglu)" in n and noted in n for n in notes)


def test_cli_convert_and_inspect(tmp_path, relu_llama):
    folder, predictors = relu_llama
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", str(folder), "-o", str(tmp_path / "m.gguf"), "--outtype", "q8_0",
                                 "--predictors", str(predictors)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "m.gguf")
    assert "wrote PowerInfer llama model" in result.stderr
    assert "reads ffn_down_t only as f16 or q4_0" in result.stderr and "no --predictors" not in result.stderr

    report = json.loads(runner.invoke(cli, ["inspect", str(tmp_path / "m.gguf"), "--json"]).stdout)
    assert report["layout"] == "powerinfer" and report["sparse_ffn"] and report["predictor_layers"] == 2
    totals = report["totals"]
    assert totals["predictor"]["tensors"] == 4
    assert totals["predictor"]["parameters"] == 2 * (PREDICTOR_HIDDEN * 64 + 80 * PREDICTOR_HIDDEN)
    assert totals["ffn"]["tensors"] == 2 * 4 and totals["embedding"]["tensors"] == 1
    assert sum(t["bytes"] for t in totals.values()) == report["total_bytes"] == sum(t["bytes"] for t in report["tensors"])
    assert report["metadata"]["tokenizer.ggml.tokens"]["length"] == report["metadata"]["llama.vocab_size"]

    text = runner.invoke(cli, ["inspect", str(tmp_path / "m.gguf")]).stdout
    assert "PowerInfer (PWRI magic, GGUF v3)" in text and "predictors in 2 of 2 layers" in text
    assert "blk.1.fc2.weight" in text and "predictor" in text


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_bundled_model_converts(tmp_path, outtype):
    path, _ = convert(str(BUNDLED), tmp_path / "tiny.gguf", outtype=outtype, progress=False)
    result = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["layout"] == "powerinfer"
    expected = expected_llama(BUNDLED, powerinfer=True)
    model = open_model_file(path)
    assert set(model.tensors) == set(expected)
    for name, t in model.tensors.items():
        assert_stored(name, t.qtype, t.data, expected[name])

