"""Prompt records with images (online RL on a vision-language model, TRL's GRPO vision records):

    {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many dots?"}]}],
     "images": ["dots/7.png"], "answer": "3"}

rendered as `bigtrain.data.prompts.PromptRenderer` renders a conversation (the chat template with the generation
prompt), then through the processor, which expands each placeholder into the family's image tokens; the images are
placed and opened as `bigtrain.data.vision.VisionRenderer` does, and kept beside the tokens. The record itself is kept
too (its other columns are the reward functions' keywords); a batch hands the functions its images opened
(`bigtrain.data.vision_rows`), as TRL's trainer hands them the dataset's decoded images.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bigtrain.data.prompts import PromptRenderer
from bigtrain.data.vision import VisionRenderer, column_images, image_count_line, open_image, place_images

__all__ = ["VisionPromptRenderer", "VisionRenderer"]


class VisionPromptRenderer(PromptRenderer):
    """record -> [(prompt token ids, all-zero mask)], the images kept in `last` (see VisionRenderer)."""

    keeps_images = True

    def __init__(self, processor: Any, fmt: str = "prompt"):
        self.vision = VisionRenderer(processor, "chat")
        super().__init__(self.vision.tok, fmt)
        self.base: Path | None = None
        self.last: list[tuple[list[bytes], int, int]] = []

    def examples(self, record: Any) -> list[tuple[list[int], list[int]]]:
        self.vision.last, self.vision.base = [], self.base
        if not isinstance(record, dict):
            return super().examples(record)  # its own line for a record that is no object
        column = column_images(record)
        if isinstance(record.get("prompt"), str) and column:
            raise ValueError("a prompt record with images needs its prompt as messages (TRL's vision formats are "
                             "conversational): give 'prompt' as [{\"role\": \"user\", \"content\": ...}]")
        prompt, refs, used = place_images(record.get("prompt"), column)
        if used != len(column):
            raise ValueError(image_count_line(used, len(column)))
        if not refs:
            raise ValueError("the prompt record has no image: every record of a vision-language run carries at least "
                             "one (an 'images' or 'image' column, or {\"type\": \"image\", \"path\": ...} items)")
        self.vision._images = [open_image(ref, self.base) for ref in refs]
        ids = self.prompt_ids(prompt, {**record, "prompt": prompt})
        self.last = self.vision.last
        return [(ids, [0] * len(ids))]

    def messages(self, messages: Any) -> list[dict]:
        return self.vision.messages(messages)

    def encode_prompt(self, text: str) -> list[int]:
        ids, _ = self.vision.encode_spans(text, [])
        return ids
