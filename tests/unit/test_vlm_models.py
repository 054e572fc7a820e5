"""Vision-language models (`--model vlm`): three families built tiny from transformers' own configs with random
weights and saved with their processors (tests/local_vlm.py: LLaVA, Idefics3, Gemma 3). What the family decides from
a directory (the class, its parts, what is frozen, the start from its weights), LoRA on the language model's layers
(the tower's only when asked), and the one-line refusals: a text model as --model vlm, a VLM as --model hf, the
splits the family has no mode for. Data, losses and training: tests/unit/test_vlm_data.py,
tests/dist/test_vlm_training.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from local_vlm import FAMILIES, make_vlm_dir

from bigtrain.models import build


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {family: make_vlm_dir(root, family, seed=i) for i, family in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_family_loads_the_directory_with_its_parts_and_freezes_the_tower(vlm_dirs, family):
    from transformers import AutoModelForImageTextToText

    from bigtrain.models.vlm import part_names
    spec = build("vlm", "custom", pretrained=str(vlm_dirs[family]), seq_len=64)
    saved = AutoModelForImageTextToText.from_pretrained(vlm_dirs[family])
    assert spec.hf_class is type(saved) and spec.modality == "vision" and spec.tokens_per_sample == 64
    model = spec.build(seed=3)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    parts = part_names(model)
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    tower, projector, language = parts["vision"][0], parts["projector"][0], parts["language"][0]
    assert not any(n.startswith(tower + ".") for n in trains)  # freeze_vision: true by default
    assert any(n.startswith(projector + ".") for n in trains) and any(n.startswith(language + ".") for n in trains)
    both = build("vlm", "custom", pretrained=str(vlm_dirs[family]), freeze_projector=True, freeze_vision=False).build()
    trains = {name for name, p in both.named_parameters() if p.requires_grad}
    assert any(n.startswith(tower + ".") for n in trains) and not any(n.startswith(projector + ".") for n in trains)
    logits = model(**spec.fixed_inputs()).logits  # the prompts with their images, through the saved processor
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()


def test_lora_adapts_the_language_model_and_the_tower_only_when_asked(vlm_dirs):
    from bigtrain.config.run_config import LoraConfig
    from bigtrain.parallel.lora import apply_lora
    spec = build("vlm", "custom", pretrained=str(vlm_dirs["llava"]))
    adapted = {}
    for tower in (False, True):
        model = spec.build(seed=0)
        counts = apply_lora(model, spec, LoraConfig(r=4, vision_tower=tower), seed=0)
        adapted[tower] = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
        assert counts.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapted[False] and all(n.startswith("model.language_model.") for n in adapted[False])
    assert not any("lm_head" in n or "projector" in n for n in adapted[True])
    assert {n for n in adapted[True] if n.startswith("model.vision_tower.")} == adapted[True] - adapted[False] != set()
    model = spec.build(seed=0)
    apply_lora(model, spec, LoraConfig(r=4, targets=["q_proj", "v_proj"]), seed=0)
    names = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert names == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="no linear layer of the language model has that name"):
        apply_lora(spec.build(seed=0), spec, LoraConfig(r=4, targets=["fc1"]), seed=0)  # the tower's MLP only


def test_wrong_family_and_unsupported_splits_are_one_line(vlm_dirs, tmp_path):
    from local_hf import decoder_config

    from bigtrain.config.load import load_run_config
    from bigtrain.train.precheck import check_run
    with pytest.raises(ValueError, match="vision-language model .*train it with --model vlm"):
        build("hf", "custom", pretrained=str(vlm_dirs["llava"]))
    decoder_config("llama", 300).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="reads no images .*train it with --model hf"):
        build("vlm", "custom", pretrained=str(tmp_path / "llama"))
    with pytest.raises(ValueError, match="not cut into pipeline stages; set pipeline.stages=1"):
        build("vlm", "custom", pretrained=str(vlm_dirs["gemma3"])).layers()
    for extra, needle in (({"pipeline": {"stages": 2}}, "pipeline.stages=2: the vlm family is not cut"),
                          ({"parallel": {"tensor": 2}}, "parallel.tensor=2: the vlm family does not support tensor"),
                          ({"parallel": {"sequence": 2}}, "parallel.sequence=2: the vlm family does not support")):
        run = load_run_config(base={"model": {"family": "vlm", "pretrained": str(vlm_dirs["llava"])},
                                    "train": {"out_dir": str(tmp_path / "out")}, **extra})
        with pytest.raises(ValueError, match=needle):
            check_run(run)
