"""Last adjustments to a resolved DeepSpeed config for the device and output directory of this job."""
from __future__ import annotations

import copy
import logging
from pathlib import Path

from bigtrain.config.run_config import RunConfig
from bigtrain.ds.generate import monitor_sections
from bigtrain.metrics.monitor import tracker_sections

log = logging.getLogger("bigtrain")


def fit_to_device(ds_config: dict, run: RunConfig, out_dir: str | None, device_name: str | None = None,
                  notes: list[str] | None = None) -> dict:
    """Monitors under `out_dir` (none when it is None); torch's Adam on a CPU unless the optimizer is
    offloaded; the schedule as long as the job; DeepCompile's switch for train.compile=deepcompile (a
    train.compile that cannot run on this device is a ValueError). What changed goes to `notes` (else the log).

    DeepSpeed's FusedAdam on the CPU accelerator is a C++ extension built at first use; torch's
    fused AdamW does the same math with no build step (`optimizer.torch_adam` overrides).
    """
    if device_name is None:
        from deepspeed.accelerator import get_accelerator
        device_name = get_accelerator().device_name()
    config = copy.deepcopy(ds_config)
    if out_dir is not None:
        config.update(monitor_sections(out_dir, "train", run.logging.tensorboard, run.logging.csv))
        config.update(tracker_sections(run.logging, out_dir, Path(out_dir).name))  # wandb / comet
    note = _fit_schedule_length(config, run.train.steps)
    if note:
        notes.append(note) if notes is not None else log.info("%s", note)
    optimizer = config.get("optimizer") or {}
    params = optimizer.setdefault("params", {}) if optimizer else {}
    zero = config.get("zero_optimization") or {}
    offloaded = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    is_adam = str(optimizer.get("type", "")).lower() in ("adam", "adamw", "muon")  # muon: its Adam half
    if is_adam and "torch_adam" not in params:
        wanted = run.optimizer.torch_adam
        if wanted is None:
            wanted = device_name == "cpu" and not offloaded
        if wanted:
            params["torch_adam"] = True
    stages = (config.get("pipeline") or {}).get("stages", 1)
    if resolve_compile(run.train.compile, device_name, stages, zero.get("stage", 0)) == "deepcompile":
        config["compile"] = {**config.get("compile", {}), "deepcompile": True}  # switched on before initialize
    return config


def resolve_compile(setting: bool | str, device_name: str, pipeline_stages: int, zero_stage: int) -> str:
    """`train.compile` -> "off" | "torch" | "deepcompile" for this job; a combination that cannot run is a
    ValueError naming the fix."""
    if setting == "auto":  # ZeRO-3: DeepSpeed's per-module hooks split the graph at every layer (see below)
        wanted = device_name != "cpu" and pipeline_stages == 1 and zero_stage != 3
        return "torch" if wanted and not dynamo_disabled() else "off"
    if setting is False:
        return "off"
    if dynamo_disabled():  # torch.compile would return the model as it is: a run that says "compiled" and is not
        raise ValueError(f"train.compile={_text(setting)} but TORCHDYNAMO_DISABLE=1 in this environment turns "
                         "torch.compile off; unset TORCHDYNAMO_DISABLE, or set train.compile=false")
    if pipeline_stages > 1:
        raise ValueError(f"train.compile={_text(setting)} with pipeline.stages={pipeline_stages}: bigtrain compiles "
                         "plain modules only; set train.compile=false (or auto)")
    if setting == "deepcompile":
        if device_name != "cuda":
            raise ValueError(f"train.compile=deepcompile needs an NVIDIA GPU (DeepSpeed's DeepCompile runs on CUDA "
                             f"only; this job runs on {device_name}); use train.compile=true for torch.compile")
        if zero_stage == 0:
            raise ValueError("train.compile=deepcompile needs zero.stage 1, 2 or 3; use train.compile=true at "
                             "ZeRO-0")
        return "deepcompile"
    if device_name == "cpu" and not cpp_compiler():
        raise ValueError(f"train.compile={_text(setting)} on a CPU needs a C++ compiler (inductor builds C++ kernels) "
                         "and none is on PATH: install g++ (scripts/setup.sh does), or set train.compile=false")
    return "torch"


def dynamo_disabled() -> bool:
    """Whether torch's TORCHDYNAMO_DISABLE=1 is set: every torch.compile in the process is then a no-op."""
    import os
    return os.environ.get("TORCHDYNAMO_DISABLE", "") == "1"


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on a CPU ($CXX, else g++ or c++), or None."""
    import os
    import shutil
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
    return next((path for name in candidates if (path := shutil.which(name))), None)


def _text(setting: bool | str) -> str:
    return str(setting).lower() if isinstance(setting, bool) else setting


def _fit_schedule_length(config: dict, steps: int) -> str | None:
    """The job's step count decides how long the LR schedule runs, whatever a config file was written for."""
    params = (config.get("scheduler") or {}).get("params") or {}
    if "total_num_steps" in params and params["total_num_steps"] != steps:
        note = f"scheduler.params.total_num_steps {params['total_num_steps']} -> {steps} (train.steps)"
        params["total_num_steps"] = steps
        if isinstance(params.get("warmup_num_steps"), int) and params["warmup_num_steps"] > steps:
            params["warmup_num_steps"] = steps
        return note
    return None
