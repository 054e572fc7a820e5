"""Records with images (TRL's vision formats) for vision-language models, on three families built tiny from
transformers' configs and saved with their processors (tests/local_vlm.py): a micro-batch's loss equals
transformers' own forward on the processor's batch of the same records, the images are kept beside the tokens by
`bigtrain prepare`, and a bad record is one line before any rank starts. Training on 2 ranks:
tests/dist/test_vlm_training.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from local_vlm import (FAMILIES, PLACEHOLDER, TAGGED, chat_records, make_vlm_dir, noise_image, write_images,
                       write_jsonl)

from bigtrain.data import build_data
from bigtrain.data.formats import ExampleOptions

SEQ = 96


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm_data")
    rng = np.random.default_rng(0)
    paths = write_images(root / "imgs", [noise_image(rng, (40 - 2 * i, 28 + 3 * i)) for i in range(6)])
    records = chat_records(paths, 12)
    return {"root": root, "records": records, "chat": write_jsonl(root / "chat.jsonl", records),
            **{family: make_vlm_dir(root, family, seed=i) for i, family in enumerate(FAMILIES)}}


def bundle(vlm: dict, family: str, source: Path | None = None, tag: str = ""):
    root = vlm["root"]
    return build_data(str(source or vlm["chat"]), "vision", seq_len=SEQ, tokenizer=str(vlm[family]),
                      tokenizer_dir=root / f"tok-{family}{tag}", cache_dir=root / f"cache-{family}{tag}", num_proc=1,
                      examples=ExampleOptions())


def transformers_loss(directory: Path, records: list[dict], base: Path) -> float:
    """transformers' own route, as a user of its classes computes the loss: the records as conversations whose image
    items carry their files, the processor's apply_chat_template (the template with the assistant's turns marked)
    tokenizing, expanding the placeholders and masking the answers, the family's class computing its loss."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(directory)
    family = next(f for f in FAMILIES if directory.name == f)
    processor.chat_template = TAGGED.replace("IMAGE", PLACEHOLDER[family])
    conversations = []
    for record in records:
        images = iter(record["images"])
        conversations.append([{**m, "content": [{"type": "image", "path": str(base / next(images))}
                                                 if item["type"] == "image" else item for item in m["content"]]}
                              for m in record["messages"]])
    batch = processor.apply_chat_template(conversations, tokenize=True, return_dict=True, return_tensors="pt",
                                          return_assistant_tokens_mask=True, processor_kwargs={"padding": True})
    labels = batch["input_ids"].masked_fill(batch.pop("assistant_masks") == 0, -100)
    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    inputs = {k: v for k, v in batch.items() if k in processor.model_input_names}
    with torch.no_grad():
        return float(model(**inputs, labels=labels).loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_micro_batch_loss_equals_transformers_own_forward(vlm, family):
    from bigtrain.models import build
    data = bundle(vlm, family)
    rows = [0, 1, 2, 3]  # the first has two images: images per row differ within the batch
    batch = data.train.take(rows)
    assert batch["pixels"].counts == (2, 1, 1, 2) and (batch["labels"] != -100).any()
    spec = build("vlm", "custom", pretrained=str(vlm[family]), seq_len=SEQ)
    model = spec.build(seed=0).eval()
    inputs, labels = spec.batch_to_inputs(batch)
    with torch.no_grad():
        ours = float(spec.loss(model(**inputs), labels))
    examples = [int(data.train.rows.row_examples(r)[0]) for r in rows]
    theirs = transformers_loss(vlm[family], [vlm["records"][e] for e in examples], vlm["root"])
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    assert "image tokens a record" in data.description


def test_images_in_content_items_render_as_the_images_column_does(vlm):
    """TRL's two shapes of one record (placeholders + an images column, or items carrying their image, absolute or
    relative) give the same tokens and pixels; so do plain-string messages, whose images go before the first user
    turn's text (TRL's rule), and parquet rows whose images are bytes ({"bytes", "path"}, as `datasets` writes them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    root, records = vlm["root"], vlm["records"][:6]
    items = []
    for i, record in enumerate(records):
        images = iter(record["images"])
        messages = [{**m, "content": [{"type": "image", "path": str(root / next(images)) if i % 2 else next(images)}
                                      if item["type"] == "image" else item for item in m["content"]]}
                    for m in record["messages"]]
        items.append({"messages": messages})
    strings = [{"messages": [{"role": m["role"], "content": m["content"][-1]["text"]} for m in r["messages"]],
                "images": r["images"]} for r in records]
    made = [bundle(vlm, "llava", write_jsonl(root / f"{name}.jsonl", rows), name).train.take([0, 1])
            for name, rows in (("column", records), ("items", items), ("strings", strings))]
    as_bytes = [{**r, "images": [{"bytes": (root / p).read_bytes(), "path": p} for p in r["images"]]} for r in records]
    pq.write_table(pa.Table.from_pylist(as_bytes), root / "bytes.parquet")
    made.append(bundle(vlm, "llava", root / "bytes.parquet", "parquet").train.take([0, 1]))
    for other in made[1:]:
        assert torch.equal(made[0]["input_ids"], other["input_ids"]) and torch.equal(made[0]["labels"], other["labels"])
        assert torch.equal(made[0]["pixels"].tensors["pixel_values"], other["pixels"].tensors["pixel_values"])


def test_prepare_keeps_the_images_beside_the_tokens(vlm, capsys):
    from bigtrain.data.prepare.cli import main
    from bigtrain.data.prepare.store import PreparedCorpus
    out = vlm["root"] / "prepared"
    assert main(["--data", str(vlm["chat"]), "--out", str(out), "--tokenizer", str(vlm["llava"]), "--num-proc", "1",
                 "--quiet"]) == 0
    assert "images kept beside the tokens" in capsys.readouterr().out
    corpus = PreparedCorpus(out)
    assert corpus.manifest["vision"]["images"] == sum(len(r["images"]) for r in vlm["records"])
    first = vlm["root"] / vlm["records"][0]["images"][0]
    assert corpus.images.images(0)[0] == first.read_bytes()  # the file's bytes as they were
    assert (out / "tokenizer" / "processor_config.json").is_file()
    prepared, direct = bundle(vlm, "llava", out, "prep").train.take([0, 1]), bundle(vlm, "llava").train.take([0, 1])
    assert torch.equal(prepared["input_ids"], direct["input_ids"])
    assert torch.equal(prepared["pixels"].tensors["pixel_values"], direct["pixels"].tensors["pixel_values"])
    (out / "shards" / "00000.images.bin").write_bytes(b"x")  # damaged since prepare: one line naming the repair
    with pytest.raises(ValueError, match="incomplete: shards/00000.images.bin does not hold the images .*bigtrain "
                                         "prepare"):
        PreparedCorpus(out)


def run_for(vlm: dict, source: Path, family: str = "vlm", model: Path | None = None, **extra):
    from bigtrain.config.load import load_run_config
    return load_run_config(base={"model": {"family": family, "pretrained": str(model or vlm["llava"])},
                                 "data": {"source": str(source), "seq_len": SEQ},
                                 "train": {"out_dir": str(vlm["root"] / "out")}, **extra})


def test_bad_input_is_one_line_before_launch(vlm, tmp_path):
    from local_hf import decoder_config
    from transformers import AutoTokenizer

    from bigtrain.train.precheck import check_run
    good = vlm["records"][1]
    (tmp_path / "bad.png").write_text("not an image")
    two = {**good, "messages": [{**good["messages"][0], "content": [{"type": "image"}] + good["messages"][0]["content"]},
                                good["messages"][1]]}
    cases = {"placeholders": (two, r"line 2: .*has 2 image placeholder\(s\) .*and 1 image\(s\) in its 'images'"),
             "unreadable": ({**good, "images": [str(tmp_path / "bad.png")]},
                            r"line 2: .*the image '.*bad.png' does not open as an image"),
             "missing": ({**good, "images": ["imgs/none.png"]}, r"line 2: .*the image 'imgs/none.png' is no file"),
             "offline": ({**good, "images": ["http://127.0.0.1:9/cat.png"]},
                         r"line 2: .*could not be fetched .*download the images and give their paths"),
             "no image": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                          r"line 2: .*has no image")}
    for name, (record, needle) in cases.items():
        source = write_jsonl(vlm["root"] / f"bad-{name.replace(' ', '_')}.jsonl", [good, record, good])
        with pytest.raises(ValueError, match=needle) as err:
            check_run(run_for(vlm, source))
        assert "\n" not in str(err.value) and str(source) in str(err.value)
    text_model = tmp_path / "llama"
    decoder_config("llama", 384).save_pretrained(text_model)
    AutoTokenizer.from_pretrained(vlm["llava"]).save_pretrained(text_model)
    with pytest.raises(ValueError, match="reads text only: train a vision-language model on it .*--model vlm"):
        check_run(run_for(vlm, vlm["chat"], "hf", text_model))
    bare = tmp_path / "no_processor"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vlm["llava"] / name, bare / name)
    with pytest.raises(ValueError, match="has no processor .*save it there with processor.save_pretrained"):
        check_run(run_for(vlm, vlm["chat"], model=bare))
    with pytest.raises(ValueError, match="data.packing=true with --model vlm"):
        run_for(vlm, vlm["chat"], data={"source": str(vlm["chat"]), "packing": True})
    with pytest.raises(ValueError, match="objective.reference=precomputed with --model vlm: .*without their images"):
        run_for(vlm, vlm["chat"], objective={"kind": "dpo", "reference": "precomputed"})
    with pytest.raises(ValueError, match="objective.teacher with --model vlm: .*without their images"):
        run_for(vlm, vlm["chat"], objective={"kind": "distill", "teacher": str(vlm["llava"]), "max_completion_length": 8})
    with pytest.raises(ValueError, match="objective.tools / objective.environment with --model vlm: .*without the"):
        run_for(vlm, vlm["chat"], objective={"kind": "grpo", "tools": "tools.py:add", "rewards": "accuracy",
                                             "max_completion_length": 8})
    kto = write_jsonl(vlm["root"] / "kto.jsonl", [{"prompt": good["messages"][:1], "completion": good["messages"][1:],
                                                   "label": True, "images": good["images"]}] * 3)
    with pytest.raises(ValueError, match="data.format=kto: kto answers with images are not built"):
        check_run(run_for(vlm, kto, objective={"kind": "kto"}))
    manifest = json.loads((vlm[FAMILIES[0]] / "config.json").read_text())
    assert manifest["model_type"] == "llava"
