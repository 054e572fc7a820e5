"""The checkpoint's typed state (bigtrain/checkpoint/state.py) and loading that never runs code from a
checkpoint (bigtrain/checkpoint/safe_load.py), without training; a real run, moved, exported and fed a
malicious pickle is tests/dist/test_checkpoint_moved_run.py.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bigtrain.checkpoint import store
from bigtrain.checkpoint.safe_load import (UnsafeCheckpoint, checkpoint_loading, load_torch_file,
                                           refuse_unsafe_files)
from bigtrain.checkpoint.state import VERSION, CheckpointState, ModelBuild, read_state

TAG = "step_000002"


class Exploit:
    """A pickle that writes `marker` when unpickled: what a hostile checkpoint could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def write_tag(root: Path, state: CheckpointState) -> Path:
    tag = root / "checkpoints" / store.tag_for(state.step)
    tag.mkdir(parents=True)
    for rank in range(state.world_size):
        torch.save(store.rng_state(), tag / f"rng_rank{rank}.pt")
    store.write_marker(tag, state)
    return tag


# --- the state: versions and relative paths -----------------------------------------------------

def test_marker_stores_paths_relative_and_reads_them_where_the_run_is_now(tmp_path):
    run = tmp_path / "run"
    state = CheckpointState(step=2, world_size=1, losses=[3.5, 3.25], data={"position": 8},
                            model_build=ModelBuild("gpt2", "tiny", {"vocab_size": 512}),
                            run_dir=run, tokenizer_dir=run / "tokenizer")
    tag = write_tag(run, state)
    (run / "tokenizer").mkdir()
    raw = json.loads((tag / store.MARKER).read_text())
    assert (raw["version"], raw["run_dir"], raw["tokenizer_dir"]) == (VERSION, "../..", "tokenizer")
    shutil.copytree(tag, tmp_path / "elsewhere" / TAG)  # the tag alone: the run's tokenizer where it was
    assert read_state(tmp_path / "elsewhere" / TAG).tokenizer_dir == run / "tokenizer"
    shutil.move(run, tmp_path / "moved")
    found = read_state(tmp_path / "moved" / "checkpoints" / TAG)
    assert found.run_dir == tmp_path / "moved" and found.tokenizer_dir == tmp_path / "moved" / "tokenizer"
    assert (found.step, found.losses, found.data, found.model_build) == (2, [3.5, 3.25], {"position": 8},
                                                                         ModelBuild("gpt2", "tiny", {"vocab_size": 512}))
    assert read_state(tmp_path / "elsewhere" / TAG).tokenizer_dir == tmp_path / "tokenizer"  # gone: named here


# What bigtrain wrote before the marker had a version (trimmed from a real run of that code).
V1_MARKER = {"step": 2, "world_size": 2, "data": {"num_samples": 2318, "seed": 1234, "position": 16},
             "losses": [6.25, 6.24], "model_build": {"family": "gpt2", "size": "tiny", "overrides": {"seq_len": 64}},
             "pipeline_stages": 1, "ds_config": {"train_batch_size": 8, "zero_optimization": {"stage": 2}},
             "run_config": {"train": {"out_dir": "/old/place/z2"}, "checkpoint": {"dir": None}},
             "tokenizer_dir": "/old/place/z2/tokenizer", "files": {"rng_rank0.pt": 1}}


@pytest.mark.parametrize("ckpt_setting, expected_run", [(None, "here"), ("/elsewhere/ckpts", "/old/place/z2")])
def test_version_1_marker_is_converted(tmp_path, ckpt_setting, expected_run):
    tag = tmp_path / "here" / "checkpoints" / TAG
    tag.mkdir(parents=True)
    raw = {**V1_MARKER, "run_config": {**V1_MARKER["run_config"], "checkpoint": {"dir": ckpt_setting}}}
    (tag / store.MARKER).write_text(json.dumps(raw))
    state = read_state(tag)
    run = tmp_path / expected_run if expected_run == "here" else Path(expected_run)
    assert (state.version, state.step, state.world_size, state.run_dir, state.tokenizer_dir) == (
        VERSION, 2, 2, run, run / "tokenizer")
    assert state.model_build == ModelBuild("gpt2", "tiny", {"seq_len": 64})
    assert state.ds_config["zero_optimization"] == {"stage": 2} and state.losses == [6.25, 6.24]


@pytest.mark.parametrize("version, expected", [
    (VERSION + 1, f"checkpoint layout version {VERSION + 1} is newer than this bigtrain reads \\(1-{VERSION}\\); "
                  "upgrade bigtrain"),
    (0, "unknown checkpoint layout version 0 .*not written by bigtrain"),
    ("2", "unknown checkpoint layout version '2'"),
])
def test_other_layout_versions_are_one_line_errors_not_skipped(tmp_path, version, expected):
    write_tag(tmp_path, CheckpointState(step=2, world_size=1))
    newest = write_tag(tmp_path, CheckpointState(step=4, world_size=1))
    marker = newest / store.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": version}))
    with pytest.raises(ValueError, match=expected) as err:
        store.find_resumable(tmp_path / "checkpoints")  # never falls back to step 2 silently
    assert "\n" not in str(err.value) and str(marker) in str(err.value)


# --- loading runs no code -----------------------------------------------------------------------

def test_what_deepspeed_pickles_loads_weights_only(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    saved = {"loss_scaler": LossScaler(1.0), "fp16_scaler": DynamicLossScaler(2.0 ** 16, 1000, 1, 2, False),
             "zero_stage": ZeroStageEnum.gradients, "frag": fragment_address(numel=3, start=5),
             "flat": [torch.arange(4.0)], "param_shapes": [{"w": torch.Size([2, 2])}]}
    torch.save(saved, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    loaded = load_torch_file(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert loaded["loss_scaler"].cur_scale == 1.0 and loaded["fp16_scaler"].scale_window == 1000
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["frag"] == fragment_address(3, 5)
    with checkpoint_loading(tmp_path):  # DeepSpeed's own loader (weights_only=False inside) is forced safe
        again = TorchCheckpointEngine().load(str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert torch.equal(again["flat"][0], torch.arange(4.0))
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored after the block


def test_rng_files_old_and_new_restore_the_streams(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(store.rng_state(), tmp_path / "rng_rank0.pt")
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, tmp_path / "rng_rank1.pt")  # layout 1: numpy's state as an array
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "rng_rank0.pt") == []
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    for name in ("rng_rank0.pt", "rng_rank1.pt"):
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        store.set_rng_state(store.load_rng_file(tmp_path / name))
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected, name
    refuse_unsafe_files(tmp_path)  # numpy's array is allowed in RNG files ...
    shutil.copy(tmp_path / "rng_rank1.pt", tmp_path / "other.pt")
    with pytest.raises(UnsafeCheckpoint, match="other.pt needs numpy"):
        refuse_unsafe_files(tmp_path)  # ... only there


def test_a_malicious_pickle_never_runs(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker = tmp_path / "exploit_ran"
    torch.save({"module": {"w": torch.zeros(2)}, "extra": Exploit(marker)}, tmp_path / "states.pt")
    with pytest.raises(UnsafeCheckpoint, match=r"states.pt needs builtins.exec to load.*--trust-checkpoint"):
        refuse_unsafe_files(tmp_path)
    with pytest.raises(UnsafeCheckpoint, match="needs builtins.exec"):
        load_torch_file(tmp_path / "states.pt")
    os.rename(tmp_path / "states.pt", tmp_path / "states.bin")  # not scanned: the forced load refuses it
    with pytest.raises(UnsafeCheckpoint, match=f"a file of checkpoint {tmp_path} needs builtins.exec"):
        with checkpoint_loading(tmp_path):
            TorchCheckpointEngine().load(str(tmp_path / "states.bin"))
    assert not marker.exists()
    torch.load(tmp_path / "states.bin", weights_only=False)  # what DeepSpeed would have done
    assert marker.read_text() == "ran"  # the exploit is real
