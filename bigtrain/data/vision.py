"""Records with images (TRL's vision formats) for vision-language models: where a record's images are, opening them,
and rendering the record through the model's processor.

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}],
     "images": ["photos/cat.jpg"]}                                    placeholders, the images in a column ("image"
                                                                      for one); several per record
    {"messages": [{"role": "user", "content": [{"type": "image", "path": "photos/cat.jpg"}, ...]}, ...]}
                                                                      the image in the content item ("path", "url",
                                                                      "image"); both kinds may mix, in order

As TRL's `prepare_multimodal_messages` does, a record whose messages are plain strings gets its column's images as
placeholders at the start of its first user turn. The same holds for preference records (the images belong to the
prompt) and prompt records (online RL). An image is a local path (relative to the folder of the data file that names
it; a .json array or a hub dataset: the current directory), an http(s) URL (fetched once, at prepare: a machine
without network gets one line), or bytes (parquet: {"bytes": ..., "path": ...} as `datasets` writes images). Every
record carries at least one image: under ZeRO-3 a micro-batch without one would leave the vision tower's weights
waiting to be gathered on the ranks that have images.

The conversation is rendered by the chat template as text conversations are (`bigtrain.data.chat.Renderer`: the
assistant's turns found as character spans), then the processor expands each placeholder into the family's image
tokens and tokenizes, telling where each placeholder went (`return_text_replacement_offsets`), so the spans move with
the text. Each example keeps its images' bytes as they were (`bigtrain.data.vision_store`); pixels are made from them
when a batch is taken (`bigtrain.data.vision_rows`).
"""
from __future__ import annotations

import bisect
import io
from pathlib import Path
from typing import Any

from bigtrain.data.chat import Renderer, _overlap_mask, no_template_line
from bigtrain.data.formats import PAIR_FORMATS, TEMPLATED, UNPAIRED_FORMATS

IMAGE_COLUMNS = ("images", "image")  # TRL's: a list of images, or one
IMAGE_FIELDS = tuple(f"{c}?" for c in IMAGE_COLUMNS)  # read where present (bigtrain.data.formats.FIELDS' notation)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
FETCH_TIMEOUT_S = 10.0


def has_processor(directory: str | Path) -> bool:
    return any((Path(directory) / name).is_file() for name in PROCESSOR_FILES)


def load_processor(directory: str | Path, setting: str = "model.pretrained") -> Any:
    """The processor saved in `directory` (its image processor, tokenizer and chat template); one line when there is
    none or it cannot be built here."""
    if not has_processor(directory):
        raise ValueError(f"{setting}={str(directory)!r} has no processor (no processor_config.json or "
                         "preprocessor_config.json): a vision-language model reads its images through the processor "
                         "it was trained with; save it there with processor.save_pretrained(DIR)")
    from transformers import AutoProcessor
    try:
        processor = AutoProcessor.from_pretrained(str(directory), local_files_only=True)
    except ImportError as err:  # a video processor or a torchvision-only image processor (Qwen2-VL, Pixtral)
        raise ValueError(f"the processor in {directory} cannot be built here: {str(err).strip().splitlines()[0]} "
                         "(pip install 'bigtrain[vision]' and torchvision, docs/vision.md)") from None
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{setting}={str(directory)!r}: its processor ({type(processor).__name__}) has no image "
                         "processor; give the directory of a vision-language model")
    if not processor.chat_template and not getattr(processor.tokenizer, "chat_template", None):
        raise ValueError(no_template_line(processor.tokenizer, "records with images"))
    return processor


def vision_processor(parts: list[Any], formats: list[str], tokenizer: str | None, options: Any) -> Any:
    """The processor a run's records with images are rendered with: the one saved in `tokenizer` (data.tokenizer,
    else model.pretrained), else a prepared source's own; one line for what cannot train so (a mixture, packing,
    plain text, a corpus prepared without images or with another processor)."""
    from bigtrain.data.prepare.store import read_manifest
    if len(parts) > 1:
        raise ValueError("data.source is a mixture: records with images train from one source at a time; prepare "
                         "them into one folder (or one file) and train on that")
    if options.packing:
        raise ValueError("data.packing=true with a vision-language model: packed rows keep their examples apart by "
                         "restarting positions, which the families' image-token attention does not follow; set "
                         "data.packing=false")
    if formats[0] in UNPAIRED_FORMATS:
        raise ValueError(f"data.format={formats[0]}: kto answers with images are not built (their KL counterpart is "
                         "another record's answer, without this one's images); train preference pairs (DPO) instead")
    if formats[0] == "text":
        raise ValueError("a vision-language model trains on records with images (TRL's vision formats: 'messages' "
                         "with {\"type\": \"image\"} items and an 'images' column; docs/vision.md); this data is plain "
                         "text")
    prepared = parts[0] if isinstance(parts[0], Path) else None
    source = tokenizer or (prepared / "tokenizer" if prepared else None)
    if source is None:
        raise ValueError("a vision-language model needs its processor: give model.pretrained the model's directory, "
                         "with the processor saved beside it")
    processor = load_processor(source, "model.pretrained" if tokenizer else "the prepared data's tokenizer")
    if prepared is not None:
        made = read_manifest(prepared).get("vision")
        if made is None:
            raise ValueError(f"{prepared} was prepared without images (for a text model): prepare the records again "
                             f"with the vision-language model's processor (bigtrain prepare --tokenizer MODEL_DIR)")
        if made["processor"] != processor_fingerprint(processor):
            raise ValueError(f"{prepared} was prepared with another processor than {source}'s (another image size, "
                             f"image tokens or chat template): prepare it again with --tokenizer {source}")
    tok = processor.tokenizer
    if not getattr(tok, "chat_template", None):
        tok.chat_template = processor.chat_template
    return processor


def processor_fingerprint(processor: Any) -> str:
    """What decides the image tokens a placeholder becomes: the processor's settings (image size, tokens per
    image, ...) and its chat template."""
    import hashlib
    text = processor.to_json_string() + str(processor.chat_template or "")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def carries_images(record: Any) -> bool:
    """Whether a record names any image (a column, or an image item in a message's content)."""
    if not isinstance(record, dict):
        return False
    if any(record.get(c) not in (None, []) for c in IMAGE_COLUMNS):
        return True
    return any(_image_items(value) for key, value in record.items() if isinstance(value, list))


def _image_items(messages: list) -> list[dict]:
    return [item for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            for item in m["content"] if isinstance(item, dict) and item.get("type") == "image"]


def column_images(record: dict) -> list[Any]:
    """The images of a record's `images` (a list) or `image` (one) column, in order."""
    if record.get("images") is not None:
        images = record["images"]
        return list(images) if isinstance(images, (list, tuple)) else [images]
    return [record["image"]] if record.get("image") is not None else []


def place_images(messages: Any, column: list[Any], start: int = 0) -> tuple[list[dict], list[Any], int]:
    """(messages with every image item a bare {"type": "image"} placeholder, the images in the order they appear,
    how many of `column` from `start` they used). An item that carries its image keeps it; a bare one takes the
    column's next; a conversation without any image item takes the column's images at the start of its first user
    turn (TRL's rule). ValueError when the column runs short."""
    if not isinstance(messages, list):
        return messages, [], 0
    used, images, out = start, [], []
    placeholders = sum(1 for _ in _image_items(messages))
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if placeholders == 0 and column[start:] and message.get("role") == "user" and used == start:
            text = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
            images += column[start:]
            used = len(column)
            message = {**message, "content": [{"type": "image"} for _ in column[start:]] + text}
        elif isinstance(content, list):
            items = []
            for item in content:
                if isinstance(item, dict) and item.get("type") == "image":
                    ref = next((item[k] for k in ("path", "url", "image") if item.get(k) is not None), None)
                    if ref is None:
                        if used >= len(column):
                            raise ValueError(image_count_line(placeholders, len(column)))
                        ref, used = column[used], used + 1
                    images.append(ref)
                    item = {"type": "image"}
                items.append(item)
            message = {**message, "content": items}
        out.append(message)
    return out, images, used - start


def image_count_line(placeholders: int, column: int) -> str:
    return (f"the record has {placeholders} image placeholder(s) ({{\"type\": \"image\"}} items without an image) "
            f"and {column} image(s) in its 'images' column: give one image per placeholder, in order")


def open_image(ref: Any, base: Path | None) -> tuple[Any, bytes]:
    """(the image as RGB PIL, its bytes as stored) of a path, URL, bytes or {"bytes", "path"}; ValueError naming
    the image and why it does not open."""
    from PIL import Image
    data, name = _image_bytes(ref, base)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as err:  # noqa: BLE001 -- PIL raises several types for a file that is no image
        raise ValueError(f"the image {name} does not open as an image ({type(err).__name__}: {err})") from None
    return image.convert("RGB"), data


def decode_image(data: bytes) -> Any:
    """An image stored by prepare (its bytes as given) as RGB PIL."""
    from PIL import Image
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def _image_bytes(ref: Any, base: Path | None) -> tuple[bytes, str]:
    if isinstance(ref, dict) and ref.get("bytes") is not None:
        return bytes(ref["bytes"]), repr(ref.get("path") or "(bytes)")
    if isinstance(ref, dict) and ref.get("path"):
        ref = ref["path"]
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref), "(bytes)"
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"an image is {type(ref).__name__}: give a file path, an http(s) URL, or bytes")
    if ref.startswith(("http://", "https://")):
        return _fetch(ref), repr(ref)
    path = Path(ref).expanduser()
    path = path if path.is_absolute() or base is None else base / path
    if not path.is_file():
        where = "the current directory" if base is None else "the folder of the data file that names them"
        raise ValueError(f"the image {ref!r} is no file ({path} does not exist): relative paths are read from {where}")
    return path.read_bytes(), repr(ref)


def _fetch(url: str) -> bytes:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as answer:  # noqa: S310 -- http(s) only, above
            return answer.read()
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ValueError(f"the image {url!r} could not be fetched ({reason}): this machine has no network to it; "
                         "download the images and give their paths") from None


class VisionRenderer(Renderer):
    """record -> [(token ids, trained mask)] through the processor, each example's images kept in `last` as
    (the images' bytes, how many image tokens they became, where the last one ends)."""

    keeps_images = True

    def __init__(self, processor: Any, fmt: str):
        tok = processor.tokenizer
        if not getattr(tok, "chat_template", None):
            tok.chat_template = processor.chat_template
        if fmt not in TEMPLATED and fmt not in PAIR_FORMATS and fmt not in UNPAIRED_FORMATS:
            raise ValueError(f"data.format={fmt}: records with images are conversations (TRL's vision formats: chat "
                             "'messages', preference pairs or prompts of messages); plain-text prompt/completion and "
                             "instruction records carry no image placeholders")
        super().__init__(tok, fmt)
        self.processor, self.tagged = processor, False  # the spans' path, which follows the placeholders' expansion
        self.image_ids = [i for i in processor.image_token_ids if i is not None]
        self.base: Path | None = None  # the folder relative image paths are read from
        self.last: list[tuple[list[bytes], int, int]] = []
        self._images: list[Any] = []

    def examples(self, record: dict) -> list[tuple[list[int], list[int]]]:
        self.last = []
        out = super().examples(self.placed(record))
        if not self._images:
            raise ValueError("the record has no image: every record of a vision-language run carries at least one "
                             "(an 'images' column, or {\"type\": \"image\", \"path\": ...} items); a batch without "
                             "images would leave the vision tower ungathered on its rank under ZeRO-3")
        return out

    def placed(self, record: dict) -> dict:
        """The record with its images placed (`place_images`) and opened, ready to render."""
        column = column_images(record)
        out = dict(record)
        if self.fmt in TEMPLATED:
            key = "messages" if self.fmt == "chat" else "conversations"
            out[key], refs, used = place_images(record.get(key), column)
        else:  # a pair or a kto answer: the images belong to the prompt (or, without one, to each side's head)
            out["prompt"], refs, used = place_images(record.get("prompt"), column)
            if record.get("prompt") is None:
                for side in ("chosen", "rejected"):
                    out[side], refs, used = place_images(record.get(side), column)
            elif any(_image_items(record.get(s) or []) if isinstance(record.get(s), list) else False
                     for s in ("chosen", "rejected", "completion")):
                raise ValueError("an answer holds an image item: the images of a preference record belong to its "
                                 "prompt")
            elif isinstance(record.get("prompt"), str) and column:
                raise ValueError("a record with images needs its prompt as messages (TRL's vision formats are "
                                 "conversational): give 'prompt' as [{\"role\": \"user\", \"content\": ...}]")
        if used != len(column):
            raise ValueError(image_count_line(used, len(column)))
        self._images = [open_image(ref, self.base) for ref in refs]
        return out

    def messages(self, messages: Any) -> list[dict]:
        """A conversation's messages checked as text ones are, image items allowed in user turns."""
        from bigtrain.data.chat import chat_messages
        plain = [{**m, "content": [i for i in m["content"] if i.get("type") != "image"]}
                 if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]
        checked = chat_messages(plain)
        return [{**c, "content": m["content"]} if isinstance(m.get("content"), list) else c
                for c, m in zip(checked, messages)]

    def encode_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """The processor's tokens of `text` with its images (each placeholder expanded), the spans' tokens marked."""
        placeholders = text.count(self.processor.image_token)
        if placeholders != len(self._images):
            raise ValueError(image_count_line(placeholders, len(self._images)))
        out = self.processor(text=[text], images=[[image for image, _ in self._images]], return_offsets_mapping=True,
                             return_text_replacement_offsets=True)
        ids, offsets = list(out["input_ids"][0]), out["offset_mapping"][0]
        moved = (out.get("text_replacement_offsets") or [[]])[0]
        ends = [r["span"][1] for r in moved]
        gained = [0] + [r["new_span"][1] - r["span"][1] for r in moved]
        spans = [tuple(c + gained[bisect.bisect_right(ends, c)] for c in span) for span in spans]
        image_at = [i for i, t in enumerate(ids) if t in self.image_ids]
        self.last.append(([data for _, data in self._images], len(image_at), image_at[-1] + 1 if image_at else 0))
        return ids, _overlap_mask(offsets, spans)
