"""Data a user brings that cannot be read stops with one line naming the file and the fix, never
a traceback: a binary or non-UTF-8 file among the text sources (its line too, and a malformed jsonl record's
line), from the main process, from prepare's worker processes and through `datasets` for classification;
and a prepared directory with a shard deleted or truncated, whose message gives the `bigtrain prepare`
command that makes the missing shards again (checked here to do so). No launcher: the 2-rank journey (rank 0
sees the binary file while rank 1 waits) is tests/dist/test_run_guard_journeys.py's."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from messages import naming

from bigtrain.data import build_data, ensure_tokenizer, load_tokenizer
from bigtrain.data.builtin import builtin_documents
from bigtrain.data.prepare import PreparedCorpus, prepare

DOCS = builtin_documents()[:40]  # real prose, ~200 KB


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok") / "tokenizer"
    ensure_tokenizer(directory, lambda: DOCS, vocab_size=400)
    return load_tokenizer(directory)


def _one_line_users_mistake(err: pytest.ExceptionInfo) -> str:
    """The message, checked to be what `bigtrain train` prints as one `bigtrain: ...` line (no traceback)."""
    from bigtrain.train.process import users_mistake

    message = str(err.value)
    assert err.type is ValueError and users_mistake(err.value) and "\n" not in message, message
    return message


@pytest.mark.parametrize("num_proc", [1, 2])  # 2: the errors come from worker processes
def test_a_file_that_is_not_utf8_or_a_malformed_record_is_one_line_naming_file_and_line(tmp_path, tok, num_proc):
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS[:3]):
        (tmp_path / "txt" / f"{i}.txt").write_text(d)
    binary = tmp_path / "txt" / "1.txt"  # between good files: a binary file that slipped into the corpus
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
    lines = [json.dumps({"text": d}).encode() for d in DOCS[:12]]
    lines[8] = b'{"text": "caf\xe9 in latin-1"}'
    (tmp_path / "latin1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    lines[8] = b'{"text": "an unterminated string}'
    (tmp_path / "broken.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    expect = {"txt": [str(binary), "is not UTF-8 text", "byte 0x89 at line 1", "remove it", "convert it to UTF-8"],
              "latin1.jsonl": [str(tmp_path / "latin1.jsonl"), "is not UTF-8 text", "byte 0xe9 at line 9"],
              "broken.jsonl": [f"{tmp_path / 'broken.jsonl'}: line 9 is not JSON", "one JSON object"]}
    for name, needles in expect.items():
        with pytest.raises(ValueError) as err:  # pieces of ~5 KB: the bad line sits in a later piece
            prepare(str(tmp_path / name), tok, tmp_path / f"out-{name}", num_proc=num_proc, piece_bytes=5000,
                    progress=False)
        message = _one_line_users_mistake(err)
        assert all(n in message for n in needles), message


def test_a_binary_file_is_named_when_a_tokenizer_is_trained_on_it_and_by_the_prepare_verb(tmp_path, capsys):
    from bigtrain.data.prepare.cli import main

    for i, d in enumerate(DOCS[:3]):
        (tmp_path / f"{i}.txt").write_text(d)
    (tmp_path / "2.txt").write_bytes("Привет".encode("cp1251"))  # 0xcf: Cyrillic in a Windows code page
    with pytest.raises(ValueError) as err:  # no tokenizer given: a BPE is trained on the sources first
        build_data(str(tmp_path), "text", seq_len=16, tokenizer_dir=tmp_path / "tok", cache_dir=tmp_path / "cache")
    message = _one_line_users_mistake(err)  # the file, the encoding, the byte and its line
    assert all(n in message for n in (str(tmp_path / "2.txt"), "UTF-8", "0xcf", "line 1")), message
    code = main(["--data", str(tmp_path), "--out", str(tmp_path / "out"), "--num-proc", "2", "--quiet"])
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err_lines[-1].startswith("bigtrain prepare: "), err_lines
    assert naming(err_lines[-1], str(tmp_path / "2.txt"), "UTF-8"), err_lines
    assert not any("Traceback" in line for line in err_lines), err_lines


def test_a_classification_file_that_is_not_utf8_or_not_json_is_one_line_naming_file_and_line(tmp_path):
    """`datasets` raised a UnicodeDecodeError naming no file, or a DatasetGenerationError traceback."""
    good = [json.dumps({"text": f"sample {i}", "label": i % 2}).encode() for i in range(12)]
    cases = {"latin1.jsonl": (b'{"text": "caf\xe9", "label": 1}', ("UTF-8", "0xe9", "line 5")),
             "binary.jsonl": (b"\x89PNG\x00\xff junk", ("UTF-8", "0x89", "line 5")),
             "broken.jsonl": (b'{"text": "x", "label": }', ("line 5", "JSON"))}
    for name, (bad, needles) in cases.items():
        (tmp_path / name).write_bytes(b"\n".join(good[:4] + [bad] + good[4:]) + b"\n")
        with pytest.raises(ValueError) as err:
            build_data(str(tmp_path / name), "classify", seq_len=8, vocab_size=300, num_classes=None,
                       tokenizer_dir=tmp_path / f"tok-{name}", cache_dir=tmp_path / "cache")
        message = _one_line_users_mistake(err)
        assert message.startswith(str(tmp_path / name)) and all(n in message for n in needles), message


def _damage(out: Path, how: str) -> str:
    shard = out / "shards" / "00001.bin"
    if how == "deleted":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-6])
    else:
        (out / "shards" / "00001.idx.npy").unlink()
    return "00001.idx.npy" if how == "index deleted" else "00001.bin"


@pytest.mark.parametrize("how", ["deleted", "truncated", "index deleted"])
def test_a_prepared_directory_missing_a_shard_names_the_command_that_repairs_it(tmp_path, tok, how):
    """Was a FileNotFoundError traceback on every rank. The command in the message keeps the other shards."""
    from bigtrain.data.prepare.cli import main

    write_jsonl(tmp_path / "c.jsonl", DOCS[:12])
    tok.save_pretrained(tmp_path / "tok")
    out = tmp_path / "prep"
    assert main(["--data", str(tmp_path / "c.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--out", str(out),
                 "--piece-mb", "0.005", "--num-proc", "1", "--quiet"]) == 0
    before = PreparedCorpus(out)
    tokens, ends = before.tokens(0, before.num_tokens).copy(), before.document_ends()
    shards = len(before.manifest["shards"])
    assert shards > 3, shards
    name = _damage(out, how)
    with pytest.raises(ValueError) as err:  # what every rank of a run on --data OUT does first
        build_data(str(out), "text", seq_len=16, tokenizer_dir=tmp_path / "t", cache_dir=tmp_path / "cache")
    message = _one_line_users_mistake(err)
    assert f"{out} is incomplete: shards/{name}" in message and f"1 of {shards} shards" in message, message
    command = re.search(r"run `(bigtrain prepare [^`]+)`", message).group(1)
    assert main(shlex.split(command)[2:] + ["--piece-mb", "0.005", "--quiet"]) == 0  # this test's piece size
    after = PreparedCorpus(out)
    assert after.tokens(0, after.num_tokens).tolist() == tokens.tolist()
    assert after.document_ends().tolist() == ends.tolist() and after.manifest["resumed_shards"] == shards - 1


def test_a_runs_own_prepared_cache_missing_a_shard_is_made_again(tmp_path, tok):
    write_jsonl(tmp_path / "c.jsonl", DOCS[:12])
    tok.save_pretrained(tmp_path / "tok")
    kw = dict(seq_len=16, tokenizer=str(tmp_path / "tok"), tokenizer_dir=tmp_path / "t", cache_dir=tmp_path / "cache")
    first = build_data(str(tmp_path / "c.jsonl"), "text", **kw)
    (cached,) = (tmp_path / "cache").glob("prepared-*")
    (cached / "shards" / "00000.bin").unlink()
    again = build_data(str(tmp_path / "c.jsonl"), "text", **kw)
    rows = list(range(len(first.train)))
    assert len(again.train) == len(rows) and torch.equal(again.train.take(rows)["input_ids"],
                                                          first.train.take(rows)["input_ids"])
