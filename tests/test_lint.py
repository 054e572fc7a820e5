"""`bigtrain lint`: each bad input exits non-zero with one line naming the key and the fix."""
import json
import subprocess
import sys

import pytest

from bigtrain.cli import main
from bigtrain.config.run_config import RunConfig
from bigtrain.ds.lint import DeviceCaps
from bigtrain.ds.resolve import resolve_ds_dict

GOOD = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2}}


def lint(tmp_path, capsys, config, *args):
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    code = main(["lint", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


def with_(**changes):
    config = json.loads(json.dumps(GOOD))
    for dotted, value in changes.items():
        node = config
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config


BAD = [
    ("", [], "the file is empty"),
    ("{not json", [], "not valid JSON"),
    ("[1, 2]", [], "top level must be a JSON object"),
    (with_(train_batch_sise=16), [], "unknown key 'train_batch_sise': did you mean 'train_batch_size'?"),
    (with_(zero_optimization__stage3_prefetch_bucket_sz=5), [],
     "unknown key 'zero_optimization.stage3_prefetch_bucket_sz': did you mean 'stage3_prefetch_bucket_size'?"),
    (with_(zero_optimization__offload_optimizer={"device": "cpu", "pinned": True}), [],
     "unknown key 'zero_optimization.offload_optimizer.pinned'"),
    (with_(optimizer__params__learning_rate=1e-3), [], "unknown key 'optimizer.params.learning_rate'"),
    (with_(bf16__enable=True), [], "unknown key 'bf16.enable': did you mean 'enabled'?"),
    (with_(), ["--world-size", "4"], "train_batch_size=16 != train_micro_batch_size_per_gpu 4 x "
                                     "gradient_accumulation_steps 2 x data-parallel size 4 (= 32)"),
    (with_(pipeline={"stages": 2}), ["--world-size", "4"], "zero_optimization.stage=2 with 2 pipeline stages"),
    (with_(zero_optimization__offload_param={"device": "cpu"}), [],
     "zero_optimization.offload_param needs stage 3 (got stage 2)"),
    (with_(zero_optimization__offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}), [],
     "zero_optimization.offload_optimizer.device=nvme needs stage 3"),
    (with_(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/no/such/nvme"}}), [],
     "zero_optimization.offload_param.nvme_path='/no/such/nvme' does not exist"),
    (with_(fp16={"enabled": True}), [], "fp16.enabled and bf16.enabled are both true"),
    (with_(train_micro_batch_size_per_gpu=0), [], "train_micro_batch_size_per_gpu=0: must be a positive integer"),
    (with_(gradient_accumulation_steps=-2), [], "gradient_accumulation_steps=-2: must be a positive integer"),
    (with_(scheduler={"type": "WarmupCosine", "params": {}}), [], "scheduler.type='WarmupCosine' is not a DeepSpeed scheduler"),
    (with_(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_min": 0}}), [],
     "unknown key 'scheduler.params.warmup_min': did you mean 'warmup_min_lr'?"),
    (with_(gradient_clipping="auto", zero_optimization__zero_hpz_partition_size="auto"), [],
     "zero_optimization.zero_hpz_partition_size=\"auto\": bigtrain cannot derive this key"),
]


@pytest.mark.parametrize("config, args, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_input_is_one_clear_line(tmp_path, capsys, config, args, message):
    code, out, err = lint(tmp_path, capsys, config, *args)
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.startswith("bigtrain lint: ")]
    assert any(message in line for line in lines), err
    assert "Traceback" not in err


def test_missing_file(tmp_path, capsys):
    assert main(["lint", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_device_dependent_checks():
    cpu_without_fp16 = DeviceCaps("cpu", fp16=False, bf16=True)
    fp16 = {**GOOD, "bf16": {"enabled": False}, "fp16": {"enabled": True}}
    with pytest.raises(ValueError, match="no fp16 support"):
        resolve_ds_dict(fp16, RunConfig(), None, device=cpu_without_fp16)
    for optimizer in ("Lamb", "OneBitAdam"):
        lamb = {**GOOD, "optimizer": {"type": optimizer, "params": {"lr": 1e-3}}}
        with pytest.raises(ValueError, match=f"optimizer.type='{optimizer}' has no CPU kernel"):
            resolve_ds_dict(lamb, RunConfig(), None, device=DeviceCaps("cpu", True, True))
        resolve_ds_dict(lamb, RunConfig(), None, device=DeviceCaps("cuda", True, True))  # fine on a GPU


def test_hf_style_auto_values_are_resolved(tmp_path, capsys):
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"}}
    code, out, err = lint(tmp_path, capsys, hf, "--world-size", "4", "--set", "batch.micro_batch=2",
                          "--set", "optimizer.lr=3e-4", "--set", "train.steps=50", "--set", "precision=bf16")
    assert code == 0, err
    resolved = json.loads(out)
    assert (resolved["train_batch_size"], resolved["train_micro_batch_size_per_gpu"],
            resolved["gradient_accumulation_steps"]) == (8, 2, 1)
    assert resolved["optimizer"]["params"]["lr"] == 3e-4 and resolved["bf16"]["enabled"] is True
    assert resolved["fp16"]["enabled"] is False and resolved["scheduler"]["params"]["total_num_steps"] == 50
    assert resolved["zero_optimization"]["reduce_bucket_size"] == RunConfig().zero.reduce_bucket_size
    assert "auto" not in out


def test_good_file_prints_resolved_json_via_console_script(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(GOOD))
    proc = subprocess.run([sys.executable, "-m", "bigtrain.cli", "lint", str(path), "--world-size", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["train_batch_size"] == 16
