"""Record what DeepSpeed itself says about each public config in tests/data/public_ds_configs/.

    .venv/bin/python scripts/judge_ds_configs.py            # judge every file, rewrite manifest.json
    .venv/bin/python scripts/judge_ds_configs.py --only NAME --print

Each file is judged in its own CPU process (world size 1, gloo), so no DeepSpeed state leaks
from one file to the next. The verdict is DeepSpeed's, not bigtrain's: bigtrain's lint is tested
against these recorded verdicts (tests/unit/test_public_configs.py), and this script is the only place
that runs DeepSpeed on them. How a file is judged, in order:

1. read the file the way DeepSpeed reads a config path: hjson with DeepSpeed's own duplicate-key
   hook (`dict_raise_error_on_duplicate_keys`);
2. fill HF-style "auto" values the way the Hugging Face integration does before DeepSpeed sees
   them (transformers' HfTrainerDeepSpeedConfig.trainer_config_process/_finalize with default
   TrainingArguments, plus the keys accelerate's DeepSpeedPlugin fills); see HF_FILLS;
3. a batch triple written for another data-parallel size (all three keys given, train_batch_size
   = micro x accum x N) is checked by DeepSpeedConfig at that N (an mpu reporting N), then
   refitted to world size 1 (train_batch_size = micro x accum) for initialize;
4. `deepspeed.runtime.config.DeepSpeedConfig(config, mpu)` - DeepSpeed's config parser;
5. `deepspeed.initialize` on a toy model. A file without an "optimizer" section gets a client
   optimizer as the HF Trainer passes one through accelerate: torch AdamW, mapped to
   DeepSpeedCPUAdam by accelerate's `map_pytorch_optim_to_deepspeed` when the optimizer is
   offloaded (and `zero_force_ds_cpu_optimizer` is not false), with
   `"zero_allow_untested_optimizer": true` set as the Trainer sets it;
6. judged as on a GPU host (`--device cuda`): fp16 is allowed although this CPU may lack it,
   FusedLamb's CUDA kernel load is stubbed (its constructor still checks the params), NVMe
   offload runs as CPU offload (the nvme_path is the cluster's). Each such substitution is
   recorded; a config rejected only for the device would be accepted on a GPU host.

A file that asks for tensor parallelism (`tensor_parallel.autotp_size` N > 1) is judged at the world size it is
written for, N ranks (one process each), on a tiny Llama (what AutoTP splits; the toy model has no plan), with the
batch HF fills for N ranks: at world size 1, DeepSpeed refuses any such file, whatever its users run it on.

accept = steps 1-5 pass; reject = the first step that raises, with DeepSpeed's message.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "public_ds_configs"
MARK = "JUDGE-RESULT "
HIDDEN = 16  # the toy model's width: HF derives bucket sizes from the model's hidden_size

# key path -> value HF's integration puts there when the file says "auto" (TrainingArguments
# defaults: per_device_train_batch_size 8, gradient_accumulation_steps 1, lr 5e-5, betas
# (0.9, 0.999), eps 1e-8, weight_decay 0, max_grad_norm 1, fp16/bf16 off, 10 training steps).
HF_FILLS = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 8,  # world_size 1 x 8 x 1
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 5e-5,
    "scheduler.params.total_num_steps": 10,
    "scheduler.params.warmup_num_steps": 1,
    "fp16.enabled": False,
    "bf16.enabled": False,
    "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
    "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
    "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN,
    # accelerate's DeepSpeedPlugin (plugin_to_config_mapping, _prepare_deepspeed defaults)
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.offload_optimizer.device": "none",
    "zero_optimization.offload_param.device": "none",
}


def fill_auto(config: dict) -> list[str]:
    """Replace "auto" at the HF-filled key paths (in place); return the paths filled."""
    filled = []
    for path, value in HF_FILLS.items():
        *parents, last = path.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) == "auto":
            node[last] = copy.deepcopy(value)
            filled.append(path)
    return filled


class FixedWorld:
    """An mpu stand-in so DeepSpeedConfig checks the batch triple at the size it was written for."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def written_dp(config: dict) -> int | None:
    """The data-parallel size a complete batch triple was written for, if not 1."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    total, micro, accum = (config.get(k) for k in keys)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (total, micro, accum)):
        return None
    if total % (micro * accum) or total == micro * accum:
        return None
    return total // (micro * accum)


def gpu_host_substitutions(config: dict) -> list[str]:
    """Make this CPU process judge the config as a GPU host would (in place); say what changed."""
    import deepspeed.ops.lamb.fused_lamb as fused_lamb
    from deepspeed.accelerator import get_accelerator
    notes = []
    acc = get_accelerator()
    fp16 = config.get("fp16")
    if isinstance(fp16, dict) and fp16.get("enabled") is True and not acc.is_fp16_supported():
        type(acc).is_fp16_supported = lambda self: True
        notes.append("fp16: this CPU has none; judged as a GPU host (fp16 allowed)")
    opt = config.get("optimizer")
    if isinstance(opt, dict) and str(opt.get("type", "")).lower() == "lamb":
        class _NoKernel:
            def load(self):
                return None
        fused_lamb.FusedLambBuilder = _NoKernel
        notes.append("Lamb: FusedLamb's CUDA kernel load stubbed (its constructor still checks params)")
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        for key in ("offload_optimizer", "offload_param"):
            section = zero.get(key)
            if isinstance(section, dict) and section.get("device") == "nvme":
                section["device"] = "cpu"
                notes.append(f"zero_optimization.{key}: NVMe (aio) judged as CPU offload")
    return notes


def client_optimizer(config: dict, model):
    """What the HF Trainer + accelerate hand DeepSpeed when the JSON has no optimizer section."""
    import torch
    config["zero_allow_untested_optimizer"] = True  # transformers' deepspeed_optim_sched sets it
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    if offload.get("device", "none") != "none" and config.get("zero_force_ds_cpu_optimizer", True):
        from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed
        optimizer = map_pytorch_optim_to_deepspeed(optimizer)
    return optimizer


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if type(err).__name__ == "ValidationError":  # pydantic: header + the first field error
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        line = "; ".join(lines[:3])
    return f"{type(err).__name__}: {line}"[:400]


def split_world(path: Path) -> int:
    """The ranks a file is written for: its AutoTP size (1 without one, or for a file that does not parse)."""
    try:
        import hjson
        section = json.loads(json.dumps(hjson.loads(path.read_text()))).get("tensor_parallel")
    except Exception:  # noqa: BLE001 - judged (and refused) at one rank
        return 1
    size = section.get("autotp_size", 1) if isinstance(section, dict) else 1
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


def toy_model(world: int):
    """The toy model, or at a split world a tiny Llama that AutoTP shards (its heads divide by `world`)."""
    import torch
    if world == 1:
        return torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 4))
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=1, num_attention_heads=2 * world,
                                        num_key_value_heads=2 * world, max_position_embeddings=32))


def judge_one(path: Path) -> dict:
    """Run steps 1-5 in this process (world size 1) and return the verdict record."""
    import hjson
    import torch

    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    result: dict = {"verdict": "accept", "stage": None, "reason": None}
    try:
        with open(path) as f:
            raw = hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        raw = json.loads(json.dumps(raw))  # hjson's OrderedDicts -> plain dicts
    except Exception as err:  # noqa: BLE001 - DeepSpeed's own reader decides
        return {"verdict": "reject", "stage": "read", "reason": first_line(err)}
    config = copy.deepcopy(raw)
    result["hf_filled"] = fill_auto(config) if isinstance(config, dict) else []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "train_batch_size" in result["hf_filled"]:  # HF fills it for every rank it runs on
        config["train_batch_size"] *= world
        result["world_size"] = world
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    dp = written_dp(config) if isinstance(config, dict) else None
    try:
        DeepSpeedConfig(copy.deepcopy(config), mpu=FixedWorld(dp) if dp else None)
    except BaseException as err:  # noqa: BLE001 - SystemExit/AssertionError included
        return {**result, "verdict": "reject", "stage": "config", "reason": first_line(err)}
    if dp and dp != world:
        config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                      * world)
        result["batch"] = f"triple written for data-parallel size {dp}; refitted to {world} for initialize"
    result["device_substitutions"] = gpu_host_substitutions(config)
    torch.manual_seed(0)
    model = toy_model(world)
    client = None if "optimizer" in config else client_optimizer(config, model)
    if client is not None:
        result["client_optimizer"] = f"no optimizer section: client {type(client).__name__} passed, as HF/accelerate do"
    try:
        deepspeed.initialize(model=model, model_parameters=list(model.parameters()), optimizer=client,
                             config=config)
    except BaseException as err:  # noqa: BLE001
        return {**result, "verdict": "reject", "stage": "initialize", "reason": first_line(err)}
    return result


def run_child(name: str, port: int, timeout: float) -> dict:
    world = split_world(DATA / name)
    with __import__("tempfile").TemporaryDirectory() as tmp:  # monitors/profilers write here
        ranks = []
        for rank in range(world):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                   "OMP_NUM_THREADS": "1"}
            ranks.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(DATA / name)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp))
        outputs = [rank.communicate(timeout=timeout) for rank in ranks]
        proc = subprocess.CompletedProcess([], ranks[0].returncode, *outputs[0])  # rank 0 speaks
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"verdict": "reject", "stage": "process", "reason": f"exit {proc.returncode}: {' | '.join(tail)}"[:400]}


def versions() -> dict:
    import deepspeed
    import torch
    import transformers
    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", default=str(DATA / "manifest.json"))
    parser.add_argument("--only", action="append", default=[], help="judge only these file names")
    parser.add_argument("--print", action="store_true", help="print verdicts, do not rewrite the manifest")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(MARK + json.dumps(judge_one(Path(args.child))), flush=True)
        return 0
    manifest = json.loads(Path(args.manifest).read_text())
    entries = [e for e in manifest["files"] if not args.only or e["file"] in args.only]
    missing = set(args.only) - {e["file"] for e in entries}
    if missing:  # a new file needs its manifest entry (repo, path, commit) before it can be judged
        parser.error(f"not in {args.manifest}: {', '.join(sorted(missing))}")
    now = versions()
    recorded = {k: v for k, v in manifest.get("judged_with", {}).items() if k in now}
    start = time.time()
    for i, entry in enumerate(entries):
        verdict = run_child(entry["file"], 29600 + i % 200, args.timeout)
        if args.only and recorded and recorded != now:  # judged later than the rest: say with what
            verdict["versions"] = now
        entry.update(verdict=verdict.pop("verdict"), judged=verdict)
        print(f"{entry['verdict']:6s} {entry['file']}: {verdict.get('reason') or ''}", flush=True)
    if not args.print:
        seconds = round(time.time() - start)
        if args.only:
            seconds += manifest.get("judged_with", {}).get("seconds", 0)
        # --only keeps the versions the whole corpus was judged with; the files judged now carry their own
        base = recorded if args.only and recorded else now
        manifest["judged_with"] = {**base, "how": __doc__.split("\n\n", 2)[2].strip(), "seconds": seconds}
        Path(args.manifest).write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
