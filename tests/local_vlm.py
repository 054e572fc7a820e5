"""Vision-language models made in the test, for both tiers (tests/unit/test_vlm*.py, tests/dist/test_vlm_training.py):
three families built tiny from transformers' own configs with random weights, each saved with its processor (the
family's image processor, PIL-backed, no torchvision; a BPE trained on local words with the family's image tokens;
a Llama-3-style chat template that renders `{"type": "image"}` items as the family's placeholder), and records in
TRL's vision formats with PNG images drawn here.

    LLaVA     CLIP tower + Llama, CLIPImageProcessor (the "full" feature strategy: a CLS token per image)
    Idefics3  SigLIP-like tower + Llama, pixel shuffle connector, images padded per row (pixel_attention_mask)
    Gemma 3   SigLIP tower + Gemma 3, average-pooled image tokens between <start_of_image> / <end_of_image>
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from local_chat import sentence

FAMILIES = ("llava", "idefics3", "gemma3")
SIDE = 32  # every tower sees 32 x 32 images in 8 x 8 patches
# The template renders a message's content items in order: text as it is, an image item as the family's placeholder
# (IMAGE below), which the processor expands into the family's image tokens.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ 'IMAGE' }}{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# The same with the assistant's turns marked for transformers' own return_assistant_tokens_mask: the labels of the
# reference computation the loss tests compare with.
TAGGED = TEMPLATE.replace(
    "{% if message['content'] is string %}",
    "{% if message['role'] == 'assistant' %}{% generation %}{% for item in message['content'] %}{{ item['text'] }}"
    "{% endfor %}{{ '<|eot_id|>' }}{% endgeneration %}{% elif message['content'] is string %}").replace(
    "{{ '<|eot_id|>' }}{% endfor %}", "{% if message['role'] != 'assistant' %}{{ '<|eot_id|>' }}{% endif %}"
                                      "{% endfor %}")
PLACEHOLDER = {"llava": "<image>", "idefics3": "<image>", "gemma3": "<start_of_image>"}
CHAT_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
IDEFICS_SPECIALS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                    + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)])
DIGITS = ("zero", "one", "two", "three", "four")


def _tokenizer(specials: list[str], extra: dict | None = None):
    from transformers import PreTrainedTokenizerFast

    from bigtrain.data.tokenizer import train_bpe
    rng = random.Random(0)
    texts = [sentence(rng, 30) for _ in range(300)] + [" ".join(DIGITS + ("how", "many", "dots")) for _ in range(20)]
    bpe = train_bpe(texts, 400)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer, eos_token=bpe.eos_token,
                                  pad_token=bpe.pad_token, unk_token=bpe.unk_token, bos_token="<|begin_of_text|>",
                                  extra_special_tokens=extra or {})
    tok.add_special_tokens({"additional_special_tokens": CHAT_SPECIALS + specials})
    return tok


def _text(vocab: int, **extra):
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, **extra)


def _tower(**extra):
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=SIDE,
                patch_size=8, **extra)


def llava():
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    tok = _tokenizer(["<image>"])
    config = LlavaConfig(vision_config=CLIPVisionConfig(**_tower()), text_config=LlamaConfig(**_text(len(tok))),
                         image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="full",
                         projector_hidden_act="gelu")
    images = CLIPImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy="full", num_additional_image_tokens=1,
                               chat_template=TEMPLATE.replace("IMAGE", "<image>"))
    return LlavaForConditionalGeneration(config), processor


def idefics3():
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    tok = _tokenizer(IDEFICS_SPECIALS)
    config = Idefics3Config(vision_config=_tower(), text_config=LlamaConfig(**_text(len(tok))),
                            image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    images = Idefics3ImageProcessorPil(size={"longest_edge": SIDE}, max_image_size={"longest_edge": SIDE},
                                       do_image_splitting=False)
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                  chat_template=TEMPLATE.replace("IMAGE", "<image>"))
    return Idefics3ForConditionalGeneration(config), processor


def gemma3():
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig,
                              SiglipVisionConfig)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    marks = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok = _tokenizer(list(marks.values()), marks)
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in marks.items()}
    config = Gemma3Config(vision_config=SiglipVisionConfig(**_tower()),
                          text_config=Gemma3TextConfig(**_text(len(tok), head_dim=8, sliding_window=16)),
                          mm_tokens_per_image=4, image_token_index=ids["image_token"],
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"])
    images = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE})
    processor = Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4,
                                chat_template=TEMPLATE.replace("IMAGE", "<start_of_image>"))
    return Gemma3ForConditionalGeneration(config), processor


def make_vlm_dir(root: Path, family: str, seed: int = 0) -> Path:
    """A tiny `family` model with random weights (drawn from `seed`) and its processor, saved to root/family."""
    torch.manual_seed(seed)
    model, processor = globals()[family]()
    out = root / family
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def dots_image(count: int, rng: np.random.Generator, side: int = SIDE):
    """A white square with `count` black dots of 6 x 6 pixels at random places that do not touch."""
    from PIL import Image
    pixels = np.full((side, side, 3), 255, dtype=np.uint8)
    cells = rng.choice(16, size=count, replace=False)  # a 4 x 4 grid of 8-pixel cells: one dot a cell
    for cell in cells:
        row, col = divmod(int(cell), 4)
        y, x = row * 8 + int(rng.integers(0, 3)), col * 8 + int(rng.integers(0, 3))
        pixels[y:y + 6, x:x + 6] = 0
    return Image.fromarray(pixels)


def noise_image(rng: np.random.Generator, size: tuple[int, int] = (40, 28)):
    from PIL import Image
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def write_images(folder: Path, images: list) -> list[str]:
    """PNG files in `folder`, named 0.png, 1.png, ...; their paths relative to folder's parent."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, image in enumerate(images):
        image.save(folder / f"{i}.png")
        names.append(f"{folder.name}/{i}.png")
    return names


def chat_records(paths: list[str], n: int, seed: int = 0) -> list[dict]:
    """TRL's vision SFT records: a user turn with one or two image placeholders and a question, the answer; the
    images in an `images` column. Paths are taken in turn from `paths`."""
    rng = random.Random(seed)
    records, k = [], 0
    for i in range(n):
        count = 1 + (i % 3 == 0)
        images = [paths[(k + j) % len(paths)] for j in range(count)]
        k += count
        content = [{"type": "image"}] * count + [{"type": "text", "text": sentence(rng, rng.randint(2, 5))}]
        records.append({"messages": [{"role": "user", "content": content},
                                     {"role": "assistant", "content": [{"type": "text",
                                                                        "text": sentence(rng, rng.randint(1, 4))}]}],
                        "images": images})
    return records


def dots_records(root: Path, n: int, seed: int) -> tuple[list[dict], list[int]]:
    """The learning task: an image of 1-4 dots and the same question every time, the answer its count in words
    ("how many dots" -> "three"): only the image tells."""
    rng = np.random.default_rng(seed)
    counts = [int(c) for c in rng.integers(1, 5, size=n)]
    paths = write_images(root / f"dots{seed}", [dots_image(c, rng) for c in counts])
    records = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many dots"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": DIGITS[c]}]}],
                "images": [p]} for p, c in zip(paths, counts)]
    return records, counts


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
