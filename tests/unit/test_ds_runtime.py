"""Per-job adjustments of a resolved DeepSpeed config (device, output dir, schedule length)."""
import json
from dataclasses import replace
from pathlib import Path

from bigtrain.config.run_config import RunConfig
from bigtrain.ds.runtime import fit_to_device

ZERO1 = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / "zero1.json").read_text())
ZERO2_OFFLOAD = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / "zero2_offload.json").read_text())


def run_with(steps=200, torch_adam=None, tensorboard=False):
    run = RunConfig()
    return replace(run, train=replace(run.train, steps=steps),
                   optimizer=replace(run.optimizer, torch_adam=torch_adam),
                   logging=replace(run.logging, tensorboard=tensorboard))


def test_cpu_uses_torch_adam_unless_offloaded():
    assert fit_to_device(ZERO1, run_with(), "/out", "cpu")["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in fit_to_device(ZERO1, run_with(), "/out", "cuda")["optimizer"]["params"]
    assert "torch_adam" not in fit_to_device(ZERO2_OFFLOAD, run_with(), "/out", "cpu")["optimizer"]["params"]
    assert fit_to_device(ZERO1, run_with(torch_adam=True), "/out", "cuda")["optimizer"]["params"]["torch_adam"]


def test_schedule_length_follows_the_job_and_monitors_go_to_out():
    config = fit_to_device(ZERO1, run_with(steps=5000, tensorboard=True), "/out", "cuda")
    assert config["scheduler"]["params"]["total_num_steps"] == 5000
    assert config["csv_monitor"] == {"enabled": True, "output_path": "/out/csv", "job_name": "train"}
    assert config["tensorboard"]["output_path"] == "/out/tensorboard"
    # a generated config says "auto" (the run fills it before this step); a user's JSON may give a number
    given = json.loads(json.dumps(ZERO1))
    given["scheduler"]["params"]["warmup_num_steps"] = 20
    short = fit_to_device(given, run_with(steps=10), "/out", "cuda")["scheduler"]["params"]
    assert short["total_num_steps"] == 10 and short["warmup_num_steps"] == 10
    assert ZERO1["scheduler"]["params"]["total_num_steps"] == 200  # the input is not modified


def test_deepspeeds_muon_module_is_imported_without_torchs_inductor_and_compiles_at_first_use():
    """DeepSpeed imports its Muon module to ask whether the optimizer is Muon (engine set-up, every ZeRO-1/2 gradient
    reduction); its torch.compile decorations imported torch's inductor there, in every ZeRO job. A fresh process:
    bigtrain.train.assemble's import leaves inductor out, and the kernel is the function itself until first called."""
    import subprocess
    import sys
    code = ("import sys; from bigtrain.train.assemble import muon_compiled_at_first_use as m; m(); "
            "from deepspeed.runtime.zero.muon import original_muon as o; "
            "print('torch._inductor.compile_fx' in sys.modules, o.muon_update.__wrapped__.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split()[-2:] == ["False", "muon_update"], out.stdout[-2000:] + out.stderr[-2000:]
