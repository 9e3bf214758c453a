"""Bad hyperparameters, in a config.json or a GGUF header: one error line naming the file and the key,
exit status 1, nothing written, nothing changed. Every path builds a ``ModelSpec``, which checks them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_checks import fails, invoke, snapshot
from numpy_models import TINY, edit_config, write_gguf
from powerinfer_tools.formats.model_spec import MAX_POSITIONS

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models import spec_from_config


@pytest.fixture
def model(tmp_path, numpy_checkpoint):
    return Path(shutil.copytree(numpy_checkpoint, tmp_path / "model"))


def refused_conversion(model: Path, names: Path, match: str) -> None:
    before = snapshot(model)
    out = model.parent / "out"
    out.mkdir()
    fails("convert", model, "-o", out / "m.gguf", "-q", "--no-sparsity", names=names, match=match)
    assert list(out.iterdir()) == [] and snapshot(model) == before


@pytest.mark.parametrize("changes, match", [
    (dict(num_attention_heads=0), "num_attention_heads is 0; it must be at least 1"),
    (dict(num_hidden_layers=0), "num_hidden_layers is 0; it must be at least 1"),
    (dict(max_position_embeddings=0), "max_position_embeddings is 0"),
    (dict(max_position_embeddings=2**32 - 1), f"max_position_embeddings is 4294967295; it must be at most {MAX_POSITIONS}"),
    (dict(vocab_size=2**40), "vocab_size is 1099511627776; it must be at most"),
    (dict(hidden_size="32"), "hidden_size must be an integer, not '32'"),
    (dict(hidden_size=32.0), "hidden_size must be an integer, not 32.0"),
    (dict(hidden_size=True), "hidden_size must be an integer, not True"),
    (dict(intermediate_size=-64), "intermediate_size is -64"),
    (dict(num_key_value_heads=3), "num_attention_heads (2) is not a multiple of num_key_value_heads (3)"),
    (dict(hidden_size=33), "hidden_size (33) is not a multiple of num_attention_heads (2)"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number above 0, not nan"),
    (dict(rms_norm_eps=0), "rms_norm_eps must be a finite number above 0"),
    (dict(rope_theta=-1.0), "rope_theta must be a finite number above 0"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), "rope_scaling factor must be a finite number above 0"),
    (dict(rope_scaling=[1]), "rope_scaling must be an object"),
    (dict(sliding_window=0), "sliding_window is 0"),
    (dict(eos_token_id=4096), "eos_token_id is 4096; it must be below vocab_size (4096)"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false, not 'yes'"),
    (dict(model_type=["llama"]), "model_type ['llama'] is not supported"),
    (dict(hidden_act=["relu"]), "hidden_act=['relu'] are not supported"),
    # Written as float32: beyond its range a value would not fit (OverflowError) or would become 0.
    (dict(rope_theta=1e39), "rope_theta is 1e+39; it must fit float32"),
    (dict(rms_norm_eps=1e300), "rms_norm_eps is 1e+300; it must fit float32"),
    (dict(rms_norm_eps=1e-50), "rms_norm_eps is 1e-50; it must fit float32"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 1e308}), "rope_scaling factor is 1e+308; it must fit float32"),
])
def test_invalid_config_value_is_one_error_naming_file_and_key(model, changes, match):
    edit_config(model, **changes)
    refused_conversion(model, model / "config.json", match)


def test_config_that_is_not_an_object(model):
    (model / "config.json").write_text("[1, 2]")
    refused_conversion(model, model / "config.json", "not a JSON object")


def test_profile_checks_the_config_too(model, tmp_path):
    edit_config(model, num_attention_heads=0)
    fails("profile", model, "-o", tmp_path / "prof", names=model / "config.json", match="num_attention_heads is 0")
    assert not (tmp_path / "prof").exists()


def test_opt_config_keys_are_named_as_opt_spells_them():
    opt = dict(model_type="opt", hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=100)
    with pytest.raises(PitoolsError, match=r"^x/config.json: ffn_dim is 0; it must be at least 1$"):
        spec_from_config(dict(opt, ffn_dim=0), "x/config.json")


def test_a_list_of_end_of_sequence_ids_means_the_first():
    assert spec_from_config(dict(TINY, eos_token_id=[2, 7])).eos_token_id == 2


# --- GGUF headers: the same checks, named by metadata key ----------------------------------------

@pytest.mark.parametrize("changes, match", [
    (dict(llama__attention__head_count=0), "llama.attention.head_count is 0; it must be at least 1"),
    (dict(llama__embedding_length=0), "llama.embedding_length is 0"),
    (dict(llama__block_count=0), "llama.block_count is 0"),
    (dict(llama__context_length=2**32 - 1), "llama.context_length is 4294967295; it must be at most"),
    (dict(llama__embedding_length="32"), "llama.embedding_length must be an integer, not '32'"),
    (dict(llama__attention__head_count=[1, 2]), "llama.attention.head_count must be an integer, not [1, 2]"),
    (dict(llama__attention__layer_norm_rms_epsilon="x"), "llama.attention.layer_norm_rms_epsilon must be a finite"),
    (dict(pitools__ffn_activation="gelu"), "pitools.ffn_activation is 'gelu'; expected one of"),
])
def test_invalid_gguf_header_is_one_error_in_inspect_and_run(tmp_path, changes, match):
    path = write_gguf(tmp_path / "m.gguf", **changes)
    before = path.read_bytes()
    fails("inspect", path, names=path, match=match)
    fails("run", path, "-p", "hi", names=path, match=match)
    assert path.read_bytes() == before


def test_valid_gguf_header_is_shown(tmp_path):
    result = invoke("inspect", write_gguf(tmp_path / "m.gguf"))
    assert result.exit_code == 0 and "llama.block_count" in result.output
