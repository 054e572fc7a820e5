"""The kept table of precomputed reference log-probabilities (objective.reference=precomputed): what its key
covers, and that a damaged or foreign file is computed again, never trusted. Its numbers against the frozen copy's:
tests/dist/test_preference_training.py."""
from __future__ import annotations

import numpy as np
import pytest

from bigtrain.checkpoint.state import ModelBuild
from bigtrain.train.reference_logps import key_of, keep_table, read_table, table_ident, weight_files


class Corpus:
    def __init__(self, manifest: dict):
        self.manifest = manifest


class Part:
    def __init__(self, manifest: dict, seq_len: int):
        self.corpus, self.seq_len = Corpus(manifest), seq_len


def ident(tmp_path, seq_len=48, manifest=None, seed=1, precision=None, pretrained=True):
    build = ModelBuild("hf", "custom", {"pretrained": str(tmp_path / "model")} if pretrained else {})
    config = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    return table_ident(Part(manifest or {"shards": [{"name": "a", "tokens": 10}]}, seq_len), config, seed, build)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model" / "model.safetensors").write_bytes(b"x" * 100)
    return tmp_path / "model"


def test_the_key_changes_with_what_decides_the_numbers(tmp_path, model_dir):
    first = key_of(ident(tmp_path))
    assert key_of(ident(tmp_path)) == first
    assert key_of(ident(tmp_path, seed=2)) == first  # pretrained weights: the seed makes none of them
    assert key_of(ident(tmp_path, seq_len=64)) != first
    assert key_of(ident(tmp_path, precision="bf16")) != first
    assert key_of(ident(tmp_path, manifest={"shards": [{"name": "a", "tokens": 11}]})) != first
    (model_dir / "config.json").write_text('{"hidden_size": 16}')
    assert key_of(ident(tmp_path)) != first
    second = key_of(ident(tmp_path))
    (model_dir / "model.safetensors").write_bytes(b"y" * 101)  # weights fine-tuned again in place
    assert key_of(ident(tmp_path)) != second
    random_init = key_of(ident(tmp_path, pretrained=False))
    assert key_of(ident(tmp_path, pretrained=False, seed=2)) != random_init  # random weights: the seed makes them
    assert weight_files(tmp_path / "nowhere") == []


def test_a_kept_table_reads_back_and_a_damaged_one_is_computed_again(tmp_path):
    path = tmp_path / "prepared" / "reference_logps" / "k.npy"
    table = np.array([-3.5, -12.25, -7.0], dtype=np.float32)
    path.parent.mkdir(parents=True)
    (path.parent / f".{path.name}.999.tmp").write_bytes(b"half a table, from a job killed while writing it")
    keep_table(path, table, {"seq_len": 48})
    assert np.array_equal(read_table(path, 3), table) and path.with_suffix(".json").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert read_table(path, 4) is None  # another corpus' length
    np.save(path, np.array([-1.0, np.nan, -2.0], dtype=np.float32))
    assert read_table(path, 3) is None
    path.write_bytes(path.read_bytes()[:20])  # cut by a full disk
    assert read_table(path, 3) is None
    assert read_table(tmp_path / "absent.npy", 3) is None


def test_a_prepared_folder_it_cannot_write_is_a_warning_not_a_failure(tmp_path, caplog):
    blocked = tmp_path / "prepared" / "reference_logps"
    blocked.parent.mkdir()
    blocked.write_text("a file where the folder would go")  # what a read-only or foreign folder answers: OSError
    keep_table(blocked / "k.npy", np.zeros(2, np.float32), {})
    assert "computes them again" in caplog.text and blocked.read_text().startswith("a file")


@pytest.mark.parametrize("stage", [0, 3])
def test_the_copy_that_computed_the_table_is_freed_before_training(one_rank_group, stage):
    """Its module and weights are garbage once released, at ZeRO-3 too, where DeepSpeed keeps every engine's
    module on a stack of its own that `destroy` leaves (the probe's engines are released the same way)."""
    import gc
    import weakref

    from bigtrain.models import build
    from bigtrain.train.reference import FrozenCopy
    from bigtrain.train.reference_logps import free
    spec = build("llama", "tiny", vocab_size=320, seq_len=32)
    config = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}}
    copy = FrozenCopy(spec, config, seed=1)
    weights = [weakref.ref(p) for p in copy.ds.module.parameters()]
    free(copy)
    gc.collect()
    assert weights and not [w for w in weights if w() is not None]
