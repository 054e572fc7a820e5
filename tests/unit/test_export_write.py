"""`bigtrain export` without a training run: a missing directory and an unknown layout are one-line errors,
a failed export leaves nothing, a ResNet export reloads through load_exported, and load_into names missing,
unexpected and mis-shaped keys (exports of real 2-rank runs: tests/dist/test_export.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bigtrain.export import load_exported
from bigtrain.export.__main__ import main as export_main
from bigtrain.export.weights import detect_layout
from bigtrain.export.write import load_into, staging_dir, write_recipe, write_safetensors


def _error(argv: list[str], capsys) -> str:
    assert export_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_missing_dir_is_a_clear_error(tmp_path: Path, capsys) -> None:
    err = _error([str(tmp_path / "nope"), "--out", str(tmp_path / "o")], capsys)
    assert "nope: no such directory" in err and "step_NNNNNN" in err


def test_unknown_layout_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "optimizer.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="unknown checkpoint layout .*optimizer.bin"):
        detect_layout(tmp_path)


def test_failed_export_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with staging_dir(tmp_path / "out") as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("crash while writing")
    assert list(tmp_path.iterdir()) == []


def test_resnet_export_reloads_with_load_exported(tmp_path: Path) -> None:
    """Non-GPT-2 families: model.safetensors + bigtrain_model.json, rebuilt by load_exported."""
    from bigtrain.models import build
    model_build = {"family": "resnet", "size": "tiny", "overrides": {}}
    spec = build("resnet", "tiny")
    torch.manual_seed(0)
    trained = spec.build().eval()
    with staging_dir(tmp_path / "out") as tmp:
        write_safetensors(tmp, spec, trained.state_dict())
        write_recipe(tmp, {"format": "safetensors", "model_build": model_build})
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(load_exported(tmp_path / "out")(x), trained(x))


def test_load_into_names_missing_and_unexpected_keys() -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"missing: bias; unexpected: extra; shape mismatch: weight \(3, 3\)"):
        load_into(model, {"weight": torch.zeros(3, 3), "extra": torch.zeros(1)})


def test_a_tokenizer_without_a_pad_gets_the_models_so_a_users_batch_pads_as_training_did(tmp_path: Path) -> None:
    """The export's tokenizer: no pad token (Llama 3's has none) -> the config's pad_token_id, which training padded
    with (load_tokenizer's end-of-text fallback); a tokenizer's own pad is kept."""
    from transformers import LlamaConfig

    from bigtrain.data.tokenizer import train_bpe
    from bigtrain.export.write import pad_like_the_model

    tok = train_bpe(["the cat sat on the mat"] * 20, 300)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    tok.pad_token = None
    pad_like_the_model(tok, LlamaConfig(vocab_size=len(tok), pad_token_id=eot))
    assert tok.pad_token == "<|eot_id|>" and tok(["a", "the cat"], padding=True)["input_ids"][0][-1] == eot
    pad_like_the_model(tok, LlamaConfig(vocab_size=len(tok), pad_token_id=0))
    assert tok.pad_token_id == eot  # its own pad stays


def test_an_export_keeps_the_models_generation_config_and_stops_where_a_chat_turn_ends(tmp_path: Path) -> None:
    """transformers' `generate` on an export reads its generation_config.json: the pretrained directory's own (an
    instruct model's stop ids and sampling settings; the export wrote one made from config.json instead), with the
    token the chat template closes a turn with among its stops (the end-of-text alone let an exported chat model's
    answer run on into made-up turns), as `bigtrain generate` stops. Without a template nothing is added."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from bigtrain.export.write import empty_hf_model
    from bigtrain.models import build
    from local_chat import make_chat_tokenizer
    from local_hf import decoder_config

    tok = make_chat_tokenizer(tmp_path / "tok")
    eot, eos = tok.convert_tokens_to_ids("<|eot_id|>"), tok.eos_token_id
    assert eot != eos
    config = decoder_config("llama", len(tok))
    config.eos_token_id = eos
    instruct = {"eos_token_id": [eos, 5], "do_sample": True, "temperature": 0.7, "top_p": 0.8,
                "repetition_penalty": 1.05}
    for name, own in (("plain", None), ("instruct", instruct)):
        directory = tmp_path / name
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        if own is not None:
            GenerationConfig(**own).save_pretrained(directory)
        spec = build("hf", "custom", pretrained=str(directory))
        gen = empty_hf_model(spec, tok).generation_config
        stops = [eos] if own is None else [eos, 5]
        assert sorted(gen.eos_token_id) == sorted([*stops, eot]), gen
        if own is not None:
            assert (gen.do_sample, gen.temperature, gen.top_p, gen.repetition_penalty) == (True, 0.7, 0.8, 1.05)
        without_template = make_chat_tokenizer(tmp_path / "plain_tok")
        without_template.chat_template = None
        kept = empty_hf_model(spec, without_template).generation_config.eos_token_id
        assert (kept if isinstance(kept, list) else [kept]) == stops


def test_a_model_directory_without_a_tokenizer_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    """transformers 5 loads an empty tokenizer from a directory with none, and generation then fails deep inside;
    eval and generate load through this, so they stop with the fix instead."""
    from bigtrain.export.write import load_tokenizer
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no tokenizer.*--tokenizer DIR"):
        load_tokenizer(str(tmp_path))
