"""Vision-language models (`--model vlm`): three families built tiny from transformers' own configs with random
weights and saved with their processors (tests/local_vlm.py: LLaVA, Idefics3, Gemma 3). What the family decides from
a directory (the class, its parts, what is frozen, the start from its weights), LoRA on the language model's layers
(the tower's only when asked), and the one-line refusals: a text model as --model vlm, a VLM as --model hf, the
splits the family has no mode for. Data, losses and training: tests/unit/test_vlm_data.py,
tests/dist/test_vlm_training.py."""
from __future__ import annotations

import re
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
    dropped = build("vlm", "custom", pretrained=str(vlm_dirs[family]), dropout=0.2).config.get_text_config()
    assert dropped.attention_dropout == 0.2 and not dropped.use_cache  # the language model's dropout, no KV cache
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


def test_estimate_counts_the_tower_and_the_image_tokens(vlm_dirs, capsys):
    import torch

    from bigtrain.cli import main
    from bigtrain.estimate.vision import image_side
    tokens = {"llava": 17, "idefics3": 4, "gemma3": 4}  # (32 / 8)^2 patches + CLS; a 2x2 pixel shuffle; 4 pooled
    for family, expected in tokens.items():
        sides = [image_side(build("vlm", "custom", pretrained=str(vlm_dirs[family]), seq_len=64, **frozen),
                            torch.float32)
                 for frozen in ({"freeze_vision": False}, {}, {"freeze_projector": True})]
        assert [s.trains for s in sides] == ["tower", "projector", "nothing"]
        assert all(s.image_tokens == expected for s in sides)
        assert sides[0].saved_bytes > sides[1].saved_bytes > sides[2].saved_bytes == 0  # all saved > features > none
    from bigtrain.estimate.activations import measured_key
    from bigtrain.estimate.shape import shape_from_spec
    trained, frozen = (build("vlm", "custom", pretrained=str(vlm_dirs["llava"]), seq_len=64, **parts)
                       for parts in ({"freeze_vision": False}, {"freeze_projector": True}))
    outside = [shape_from_spec(spec, "fp32", tiled=False, chunked=False).measured[measured_key(4)].outside
               for spec in (trained, frozen)]
    assert outside[0] - outside[1] == image_side(trained, torch.float32).saved_bytes  # in the table's acts
    assert main(["estimate", "--model", "vlm", "--set", f"model.pretrained={vlm_dirs['llava']}", "--seq-len", "64",
                 "--micro-batch", "2", "--gpu-mem", "80GB"]) == 0
    assert "an image (32x32 pixels) becomes 17 image tokens of data.seq_len" in capsys.readouterr().out


def test_generate_and_chat_read_the_images_given(vlm_dirs, capsys, tmp_path):
    """`bigtrain generate DIR --image PATH` answers as transformers' own greedy generate on the processor's batch of
    the prompt with the image before its text; a text model given --image, an image that does not open and `bigtrain
    eval` of a vision-language model are one line each."""
    import numpy as np
    from local_hf import decoder_config
    from local_vlm import noise_image
    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    from bigtrain.cli import main
    image = tmp_path / "seen.png"
    noise_image(np.random.default_rng(1)).save(image)
    directory = vlm_dirs["gemma3"]
    assert main(["generate", str(directory), "--image", str(image), "--prompt", "the cat", "--max-new-tokens", "5",
                 "--do-sample", "false"]) == 0
    ours = capsys.readouterr().out.strip()
    processor = AutoProcessor.from_pretrained(directory)
    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "the cat"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=[[Image.open(image).convert("RGB")]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    theirs = processor.tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert ours == theirs and ours
    AutoModelForCausalLM.from_config(decoder_config("llama", 384)).save_pretrained(tmp_path / "llama")
    AutoTokenizer.from_pretrained(directory).save_pretrained(tmp_path / "llama")
    (tmp_path / "broken.png").write_text("no image")
    for argv, needle in ((["generate", str(tmp_path / "llama"), "--image", str(image), "--prompt", "x"],
                          "--image: model directory .* reads text only"),
                         (["generate", str(directory), "--image", str(tmp_path / "broken.png"), "--prompt", "x"],
                          "--image .*broken.png: the image .* does not open as an image"),
                         (["eval", str(directory), "--tasks", "lambada_openai"],
                          "is a vision-language model: bigtrain eval runs lm-eval's text tasks .*hf-multimodal")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(needle, err), (needle, err)


def test_image_inputs_follow_their_rows_in_either_layout():
    """A batch's image tensors cut, repeated, reordered and stacked by rows, as a round's completions and pairs are:
    per image (LLaVA, Gemma 3: rows of 2, 1 and 2 images) and per row (Idefics3: padded to the most images a row)."""
    from bigtrain.models.pixels import PixelInputs
    from bigtrain.objectives.round_pieces import Piece
    from bigtrain.rollout.generation_batch import shuffled
    per_image = PixelInputs({"pixel_values": torch.tensor([[0.0], [0.1], [1.0], [2.0], [2.1]])}, (2, 1, 2))
    per_row = PixelInputs({"pixel_values": torch.tensor([[0.0, 0.1], [1.0, -1], [2.0, 2.1]])}, (2, 1, 2))

    def values(p: PixelInputs) -> list[float]:
        return [round(v, 1) for v in p.tensors["pixel_values"].reshape(-1).tolist() if v >= 0]

    for pixels in (per_image, per_row):
        assert values(pixels.repeat_rows(2)) == [0.0, 0.1, 0.0, 0.1, 1.0, 1.0, 2.0, 2.1, 2.0, 2.1]
        assert values(pixels.take([2, 0])) == [2.0, 2.1, 0.0, 0.1] and pixels.take([2, 0]).counts == (2, 2)
        assert values(pixels[1:3]) == [1.0, 2.0, 2.1] and values(pixels.then(pixels[1:2])) == [0.0, 0.1, 1.0, 2.0,
                                                                                             2.1, 1.0]
    rows = torch.arange(6).view(6, 1)
    images = PixelInputs({"pixel_values": torch.arange(6.0).view(6, 1)}, (1,) * 6)
    pieces = [Piece(rows[i:i + 3], torch.ones(3, 1), rows[i:i + 3], torch.ones(3, 1), pixels=images[i:i + 3])
              for i in (0, 3)]
    for piece in shuffled(pieces, torch.tensor([4, 1, 5, 0, 3, 2]), 2):  # a round's rows shuffled over two steps
        assert piece.pixels.tensors["pixel_values"].view(-1).tolist() == piece.prompt_ids.view(-1).float().tolist()
