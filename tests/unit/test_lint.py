"""`bigtrain lint`: the mistakes users make, each one line naming the key, the value and the fix.

Every case says what DeepSpeed 0.19.8 itself does with the mistake (refuses it at parse or
`initialize`, or silently ignores a setting); tests/unit/test_public_configs.py holds lint to
DeepSpeed's verdicts on other people's configs.
"""
import copy
import json
from pathlib import Path

import pytest

from messages import naming

from bigtrain.cli import main
from bigtrain.ds.lint import DeviceCaps, errors, lint_problems, warnings

REPO = Path(__file__).resolve().parents[2]
GPU = DeviceCaps("cuda", fp16=True, bf16=True, local=False)
CPU_NO_FP16 = DeviceCaps("cpu", fp16=False, bf16=True)
GOOD = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2}}


def with_(**changes):
    """GOOD with `a__b=value` set at a.b (None deletes the key)."""
    config = json.loads(json.dumps(GOOD))
    for dotted, value in changes.items():
        node = config
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return config


def lines(config, device=GPU, world_size=None):
    problems = lint_problems(config, device, world_size)
    return [str(p) for p in errors(problems)], [str(p) for p in warnings(problems)]


# (config, what the expected error line names: the key, the value, the fix) - each is something DeepSpeed refuses,
# or a setting it would drop.
MISTAKES = [
    (with_(optimizer__type="AdamWW"),  # DeepSpeed: "AdamWW is not a supported DeepSpeed Optimizer"
     ('optimizer.type="AdamWW"', "'AdamW'")),
    (with_(optimizer={"type": "sgd", "params": {"lr": 0.1}}),  # torch names match exactly: "sgd" is refused
     ('optimizer.type="sgd"', "'SGD'")),
    (with_(optimizer={"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 100}}),
     ('optimizer.type="OneBitAdam"', "0.19", "removed")),
    (with_(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": -5}}),
     ("scheduler.params", "WarmupLR", "warmup_num_steps", "positive integer", "-5")),
    (with_(scheduler={"type": "WarmupCosine", "params": {}}),
     ('scheduler.type="WarmupCosine"', "'WarmupCosineLR'")),
    (with_(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_min": 0}}),
     ("'scheduler.params.warmup_min'", "WarmupLR", "'warmup_min_lr'")),
    (with_(train_batch_size="32"),  # DeepSpeed: TypeError '>' not supported between 'str' and 'int'
     ('train_batch_size="32"', "positive integer", "'train_batch_size': 32")),
    (with_(prescale_gradients="false"),  # DeepSpeed would read the string "false" as true
     ('prescale_gradients="false"', "JSON boolean")),
    (with_(max_grad_norm=1.0),  # ignored by DeepSpeed: clipping silently off
     ("'max_grad_norm'", "gradient_clipping")),
    (with_(fp16_opt_level="O2"),
     ("'fp16_opt_level'", "bf16")),
    (with_(learning_rate=3e-4), ("'learning_rate'", "optimizer.params.lr")),
    (with_(zero_optimization=None, zero_optimisation={"stage": 3}),  # ZeRO silently off in DeepSpeed
     ("'zero_optimisation'", "'zero_optimization'")),
    (with_(zero_optimization__offload_optimizer={"device": "gpu"}),  # a pydantic error, one line per field
     ('zero_optimization.offload_optimizer.device="gpu"', "'none'", "'cpu'", "'nvme'")),
    (with_(zero_optimization__stage3_prefetch_bucket_sz=5),
     ("'zero_optimization.stage3_prefetch_bucket_sz'", "'stage3_prefetch_bucket_size'")),
    (with_(bf16__enable=True), ("'bf16.enable'", "'enabled'")),
    (with_(optimizer__params__learning_rate=1e-3),
     ("'optimizer.params.learning_rate'", "FusedAdam", "'lr'")),
    (with_(optimizer__params__max_grad_norm=1.0),  # DeepSpeed raises at initialize
     ("optimizer.params.max_grad_norm", '"gradient_clipping"')),
    (with_(sparse_attention={"mode": "fixed"}), ("sparse_attention", "removed")),
    (with_(train_batch_size=10, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1),
     ("train_batch_size=10", "multiple", "train_micro_batch_size_per_gpu 4", "gradient_accumulation_steps 1")),
    (with_(steps_per_print="auto"), ('steps_per_print="auto"',)),
    (with_(optimizer={"type": "SGD", "params": {"lr": 0.1}}),  # "You are using an untested ZeRO Optimizer"
     ('optimizer.type="SGD"', "zero_optimization.stage=2", "tested")),
    (with_(pipeline={"stages": 2}), ("zero_optimization.stage=2", "2 pipeline stages", "ZeRO 0-1")),
    (with_(fp16={"enabled": True}), ("fp16.enabled=true", "bf16.enabled=true")),
    (with_(train_micro_batch_size_per_gpu=0), ("train_micro_batch_size_per_gpu=0", "positive integer")),
    (with_(bf16=True), ("bf16=true", '{"enabled": true}')),  # DeepSpeed: TypeError
]


def test_a_split_is_judged_at_the_world_given_or_at_the_ranks_it_is_written_for():
    """autotp_size 2 needs 2 ranks: refused at 1 rank, accepted with no world size (as a complete batch triple is
    checked at the data-parallel size it was written for)."""
    config = with_(tensor_parallel={"autotp_size": 2})
    errs, _ = lines(config, world_size=1)
    assert naming(errs, "tensor_parallel.autotp_size=2", "multiple of 2", "1 rank(s)"), errs
    assert lines(config)[0] == []
    assert lines(config, world_size=4)[0] == []  # its triple is written for 2 data-parallel ranks


@pytest.mark.parametrize("config, needles", MISTAKES, ids=[m[1][0] for m in MISTAKES])
def test_mistake_is_one_line_naming_key_and_fix(config, needles):
    errs, _ = lines(config)
    assert naming(errs, *needles), errs
    assert all("\n" not in line and "validation error for" not in line for line in errs)


def test_good_config_is_clean():
    assert lines(GOOD) == ([], [])


def test_torch_optimizers_whose_init_touches_state_are_checked_without_a_traceback():
    adagrad = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adagrad", "params": {"lr": 0.01}}}
    assert lines(adagrad)[0] == []
    adagrad["optimizer"]["params"]["lr"] = -0.01
    assert any("Invalid learning rate: -0.01" in line for line in lines(adagrad)[0])


def test_every_problem_in_one_pass():
    config = with_(zero_optimisation={"stage": 1}, train_batch_size="32", optimizer__type="AdamWW",
                   _comment="tuned on 8 x A100", bf16__enable=True)
    errs, warns = lines(config)
    for key in ("zero_optimisation", "train_batch_size", "optimizer.type", "bf16.enable"):
        assert sum(key in line for line in errs) == 1, (key, errs)
    (warn,) = warns
    assert warn.startswith("warning: ") and "'_comment'" in warn and "ignored" in warn, warn


def test_keys_deepspeed_ignores_are_warnings_not_errors():
    errs, warns = lines(with_(_comment="see README", my_tool={"run_name": "x"}))
    assert errs == [] and len(warns) == 2
    errs, warns = lines(with_(zero_optimization={"stage": 0, "offload_param": {"device": "cpu"}}))
    assert errs == []  # DeepSpeed ignores offload_param below stage 3: said, not refused
    (warn,) = warns
    assert warn.startswith("warning: zero_optimization.offload_param") and "stage 3" in warn and "stage 0" in warn
    # the two fixes, and what DeepSpeed does meanwhile
    assert "zero_optimization.stage" in warn and "zero_optimization.offload_param.device" in warn, warn
    assert "ignores" in warn, warn


def test_auto_where_hf_or_deepspeed_fills_it():
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "bfloat16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_gather_16bit_weights_on_model_save": "auto",
                                "offload_param": {"device": "cpu", "buffer_size": "auto"}}}
    assert lines(hf) == ([], [])


def test_device_decides_fp16_lamb_and_nvme():
    fp16 = with_(bf16={"enabled": False}, fp16={"enabled": True})
    assert naming(lines(fp16, CPU_NO_FP16)[0], "fp16.enabled=true", "cpu", "no fp16")
    assert lines(fp16, GPU)[0] == []
    lamb = with_(optimizer={"type": "Lamb", "params": {"lr": 1e-3}}, zero_allow_untested_optimizer=True)
    assert naming(lines(lamb, CPU_NO_FP16)[0], 'optimizer.type="Lamb"', "CPU kernel")
    assert lines(lamb, GPU)[0] == []
    nvme = with_(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/no/such/nvme"}})
    assert naming(lines(nvme, CPU_NO_FP16)[0], "NVMe", "GPU-host")
    assert lines(nvme, GPU)[0] == []  # the path is the GPU host's, not this machine's
    here = DeviceCaps("cuda", True, True, local=True)
    assert naming(lines(nvme, here)[0], 'nvme_path="/no/such/nvme"', "not exist")
    # no nvme_path at all passed on a GPU host, and DeepSpeed's swapper failed inside initialize on None
    no_path = with_(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}})
    assert naming(lines(no_path, GPU)[0], "offload_param.nvme_path", "is missing", "NVMe drive")
    # Lion without an offloaded optimizer is FusedLion, a GPU kernel: it passed here and crashed the job
    lion = with_(optimizer={"type": "Lion", "params": {"lr": 1e-4}}, zero_allow_untested_optimizer=True)
    assert naming(lines(lion, CPU_NO_FP16)[0], 'optimizer.type="Lion"', "FusedLion", "offload_optimizer.device=cpu")
    assert lines(lion, GPU)[0] == []
    offloaded = copy.deepcopy(lion)
    offloaded["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert not any("Lion" in line for line in lines(offloaded, CPU_NO_FP16)[0])


def test_batch_triple_at_a_world_size():
    assert lines(GOOD, world_size=2)[0] == []
    errs = lines(GOOD, world_size=4)[0]
    assert errs and errs[0].startswith("train_batch_size=16"), errs
    for factor in ("train_micro_batch_size_per_gpu 4", "gradient_accumulation_steps 2", "data-parallel size 4"):
        assert factor in errs[0], errs


# --- through the command line ---------------------------------------------------------------------

def run_cli(tmp_path, capsys, text, *args):
    path = tmp_path / "ds.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    code = main(["lint", str(path), *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.mark.parametrize("text, message", [
    ("", "the file is empty"),
    # a section of the wrong type raised AttributeError / TypeError from bigtrain's own fitting, before the lint
    ('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": 2}', 'zero_optimization=2: must be an object'),
    ("zero_optimization:\n  stage: 2\n", 'zero_optimization="stage: 2": must be an object'),  # YAML read as hjson
    ('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": "lr=1e-3"}}',
     'optimizer.params="lr=1e-3": must be an object'),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "top level must be a JSON object"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}, "train_batch_size": 8}',
     "key 'stage' appears more than once"),
])
def test_cli_unreadable_file_is_one_line(tmp_path, capsys, text, message):
    code, out, err = run_cli(tmp_path, capsys, text, "--world-size", "1")
    assert code == 2 and out == ""
    assert any(line.startswith("bigtrain lint: ") and message in line for line in err.splitlines()), err
    if "more than once" in message:  # both duplicates named, each with its place
        assert "zero_optimization: key 'stage'" in err and "(top level): key 'train_batch_size'" in err


def test_cli_reports_every_mistake(tmp_path, capsys):
    config = with_(zero_optimization=None, zero_optimisation={"stage": 1}, train_batch_size="32",
                   bf16__enable=True, fp16={"enabled": True, "loss_scale_windw": 100})
    code, out, err = run_cli(tmp_path, capsys, config, "--world-size", "2", "--device", "cuda")
    assert code == 2 and out == ""
    problems = [line for line in err.splitlines() if line.startswith("bigtrain lint: ")]
    for key in ("'zero_optimisation'", "train_batch_size=\"32\"", "'bf16.enable'", "'fp16.loss_scale_windw'"):
        assert sum(key in line for line in problems) == 1, (key, err)


def test_cli_prints_warnings_with_the_resolved_config(tmp_path, capsys):
    code, out, err = run_cli(tmp_path, capsys, with_(_comment="from a colleague"), "--world-size", "2")
    assert code == 0, err
    assert naming(err, "warning: ", "'_comment'", "ignored"), err
    assert json.loads(out)["train_batch_size"] == 16


def test_cli_world_size_defaults_to_what_bigtrain_train_starts(tmp_path, capsys):
    """One rank per GPU, two on a CPU host: the job `bigtrain train` would start here, not DeepSpeed's count."""
    from bigtrain.launch.hosts import default_num_ranks
    count = default_num_ranks()
    config = {k: v for k, v in GOOD.items() if k != "train_batch_size"}
    code, out, err = run_cli(tmp_path, capsys, config, "--device", "cuda")
    assert code == 0, err
    assert naming(err, "no --world-size", f"{count} rank(s)", "bigtrain train"), err
    assert json.loads(out)["train_batch_size"] == 4 * 2 * count


def test_cli_judges_the_split_as_train_does(tmp_path, capsys):
    """A family that cannot split so is refused as train refuses it; a split the world cannot hold is said alone,
    without a batch error at data-parallel size 0."""
    tp2 = {**GOOD, "tensor_parallel": {"autotp_size": 2}}
    code, _, err = run_cli(tmp_path, capsys, tp2, "--world-size", "2", "--set", "model.family=gpt2")
    assert code == 2 and naming(err, "parallel.tensor=2", "gpt2", "does not support tensor"), err
    code, _, err = run_cli(tmp_path, capsys, {**tp2, "train_batch_size": 4, "gradient_accumulation_steps": 1},
                           "--world-size", "3", "--set", "model.family=llama")
    assert code == 2 and "data-parallel size 0" not in err and naming(err, "autotp_size"), err


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "ds_configs").glob("*.json")))
def test_shipped_configs_lint_clean_at_any_world_size(tmp_path, capsys, name):
    """Fitted to the world size as the runner fits them; `--device cuda` so NVMe/fp16 are judged for a GPU host."""
    stages = json.loads((REPO / "ds_configs" / name).read_text()).get("pipeline", {}).get("stages", 1)
    for world in (stages, 2 * stages, 3 * stages, 8):
        code = main(["lint", str(REPO / "ds_configs" / name), "--world-size", str(world), "--device", "cuda"])
        out, err = capsys.readouterr()
        assert code == 0, (world, err)
        assert "warning" not in err, err
        config = json.loads(out)
        assert config["train_batch_size"] == config["train_micro_batch_size_per_gpu"] * \
            config["gradient_accumulation_steps"] * world // stages


def test_deprecated_fields_warn_and_a_client_optimizer_with_them_is_refused():
    legacy = with_(zero_optimization={"stage": 2, "cpu_offload": True})
    errs, warns = lines(legacy)
    assert errs == [] and len(warns) == 1, warns
    assert naming(warns, "warning: zero_optimization.cpu_offload", "deprecated", "offload_optimizer"), warns
    errs, _ = lines(with_(optimizer=None, zero_optimization={"stage": 2, "cpu_offload": True}))
    assert len(errs) == 1, errs
    assert naming(errs, "zero_optimization.cpu_offload=true", "no optimizer section", "DeepSpeedCPUAdam"), errs
    assert '"offload_optimizer": {"device": "cpu"}' in errs[0]  # the fix


def test_schema_follows_the_installed_deepspeed(monkeypatch):
    """A key a newer DeepSpeed reads is known without a bigtrain change: the schema asks the parser."""
    from deepspeed.runtime import config as ds_config

    from bigtrain.ds.lint import schema
    config = with_(log_every_n_tokens=1000)
    assert "log_every_n_tokens" in lines(config)[1][0]  # unknown today: a warning
    original = ds_config.get_log_level
    monkeypatch.setattr(ds_config, "get_log_level",
                        lambda d: (d.get("log_every_n_tokens", 0), original(d))[1])  # "DeepSpeed 0.20"
    schema.probe.cache_clear()
    schema.top_level.cache_clear()
    try:
        assert lines(config) == ([], [])
    finally:
        monkeypatch.undo()
        schema.probe.cache_clear()
        schema.top_level.cache_clear()


# --- the whole `bigtrain lint` path judges a user's JSON by DeepSpeed's rules ----------------------
# Each case below is a config DeepSpeed 0.19.8 accepts (verdicts from scripts/judge_ds_configs.py
# --child on each dict) that `bigtrain lint` used to refuse through the run config's own rules.

HF_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto"}


def test_cli_takes_auto_where_deepspeeds_models_drop_it(tmp_path, capsys):
    """`bfloat16` is DeepSpeed's old name of `bf16`; a pydantic field DeepSpeed's model drops "auto" from keeps
    its default. Neither is filled by the HF Trainer or accelerate, and DeepSpeed takes both."""
    config = {**HF_AUTO, "bfloat16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "prefetch_bucket_size": "auto",
                                    "offload_param": {"device": "cpu", "buffer_size": "auto"}}}
    code, out, err = run_cli(tmp_path, capsys, config, "--world-size", "2", "--device", "cuda")
    assert code == 0, err
    ds = json.loads(out)
    assert ds["bfloat16"] == {"enabled": True} and "bf16" not in ds  # the run config's precision, under its old name
    assert naming(err, 'bfloat16.enabled="auto"', "old name", "bf16"), err
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu"}  # DeepSpeed's default buffer size applies
    assert naming(err, 'zero_optimization.offload_param.buffer_size="auto"',
                  "DeepSpeedZeroOffloadParamConfig", "default 100000000"), err
    assert "prefetch_bucket_size" not in ds["zero_optimization"]  # the HF Trainer fills only the stage3_ name
    assert naming(err, 'zero_optimization.prefetch_bucket_size="auto"', "DeepSpeedZeroConfig",
                  "default 50000000"), err
    assert "cannot derive" not in err


@pytest.mark.parametrize("key, value, run_field", [
    ("zero_optimization.sub_group_size", 0, "zero.sub_group_size"),  # axolotl's ZeRO-3 configs
    ("zero_optimization.allgather_bucket_size", 0, "zero.allgather_bucket_size"),
    ("gradient_clipping", -1.0, "optimizer.grad_clip"),
    ("optimizer.params.lr", 0.0, "optimizer.lr"),
    ("optimizer.params.eps", 0.0, "optimizer.eps"),
    ("optimizer.params.weight_decay", -0.1, "optimizer.weight_decay"),
    ("optimizer.params.betas", [0.9, 1.0], "optimizer.betas"),
    ("activation_checkpointing.cpu_checkpointing", True, "activation_checkpointing.cpu_checkpointing"),
    ("scheduler.params.warmup_min_ratio", 1.5, "schedule.min_lr_ratio"),
])
def test_cli_judges_a_json_value_by_deepspeeds_bound_not_the_run_configs(tmp_path, capsys, key, value, run_field):
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
              "zero_optimization": {"stage": 3}}
    node = config
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    code, out, err = run_cli(tmp_path, capsys, config, "--world-size", "2", "--device", "cuda")
    assert code == 0, err
    ds = json.loads(out)
    node = ds
    for part in key.split("."):
        node = node[part]
    assert node == value  # it runs as the JSON says
    lines = [line for line in err.splitlines() if line.startswith(f"note: {key}=")]
    assert len(lines) == 1 and f"the recorded run config keeps {run_field}=" in lines[0], err


def test_cli_offload_below_its_stage_is_a_warning_naming_the_json_key(tmp_path, capsys):
    """DeepSpeed runs these and ignores the offload (the README says lint warns)."""
    for stage, key in ((2, "offload_param"), (0, "offload_optimizer")):
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, key: {"device": "cpu"}}}
        code, out, err = run_cli(tmp_path, capsys, config, "--world-size", "2", "--device", "cuda")
        assert code == 0, err
        warns = [line for line in err.splitlines() if line.startswith("warning: ")]
        assert len(warns) == 1 and warns[0].startswith(f"warning: zero_optimization.{key} needs stage"), err
        assert "(DeepSpeed ignores it at this stage)" in warns[0]
        assert "offload.param" not in err and "offload.optimizer" not in err  # never the run config's field names
        assert json.loads(out)["zero_optimization"][key] == {"device": "cpu"}
    # NVMe optimizer offload below stage 3: DeepSpeed's stage 1-2 optimizer offloads any device but "none" to CPU
    # memory (judged: accepted, NVMe run as CPU offload as the judge runs it on a GPU host's behalf)
    config = {"train_micro_batch_size_per_gpu": 4,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}
    code, out, err = run_cli(tmp_path, capsys, config, "--world-size", "2", "--device", "cuda")
    assert code == 0, err
    warns = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warns) == 1 and warns[0].startswith("warning: zero_optimization.offload_optimizer.device=nvme"), err
    assert "stage 3" in warns[0] and "CPU memory" in warns[0], err


@pytest.mark.parametrize("batch, named", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
     ("train_batch_size=10", "multiple", "train_micro_batch_size_per_gpu 4", "gradient_accumulation_steps 1")),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     ("train_batch_size=10", "multiple", "train_micro_batch_size_per_gpu 4")),
])
def test_cli_batch_that_holds_at_no_world_size_is_an_error(tmp_path, capsys, batch, named):
    """DeepSpeed refuses it at every world size; fitting is for a triple written for another size."""
    code, out, err = run_cli(tmp_path, capsys, batch, "--world-size", "2", "--device", "cuda")
    assert code == 2 and out == ""
    problems = [line for line in err.splitlines() if line.startswith("bigtrain lint: ")]
    assert len(problems) == 1 and naming(problems, *named, "no world size fits"), err


def test_cli_fits_a_batch_written_for_another_world_size_and_says_so(tmp_path, capsys):
    triple = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    code, out, err = run_cli(tmp_path, capsys, triple, "--world-size", "4", "--device", "cuda")
    assert code == 0 and json.loads(out)["gradient_accumulation_steps"] == 1
    assert naming(err, "note: batch triple", "data-parallel size 4", "was 2"), err
    pair = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}  # holds at 1, 2, 4; not at 8
    code, out, err = run_cli(tmp_path, capsys, pair, "--world-size", "8", "--device", "cuda")
    assert code == 0 and json.loads(out)["train_batch_size"] == 32
    assert naming(err, "note: batch triple", "data-parallel size 8", "16 -> 32"), err


def test_batch_lines_say_what_the_set_values_did(tmp_path, capsys):
    """A JSON triple that holds at this world size, changed by --set batch.global_batch, is said to be changed for
    the --set value (not 'the JSON's values do not hold'); three inconsistent --set values are named as --set's."""
    code, _, err = run_cli(tmp_path, capsys, GOOD, "--world-size", "2", "--set", "batch.global_batch=8")
    assert code == 0 and naming(err, "to hold --set batch.global_batch=8", "micro 4 x accum 1"), err
    assert "do not hold" not in err and "derived the global batch" not in err
    code, _, err = run_cli(tmp_path, capsys, GOOD, "--world-size", "2", "--set", "batch.global_batch=8",
                           "--set", "batch.micro_batch=2", "--set", "batch.grad_accum=3")
    assert code == 2 and naming(err, "--set batch.global_batch=8", "micro 2 x accum 3") and "JSON" not in err, err


def test_lint_in_one_thread_leaves_every_other_threads_optimizers_whole(monkeypatch):
    """Tune's trials lint their configs in threads beside a Ray Train job's driver: a scheduler check held half
    way in one thread must not change how another thread's real optimizer is built (a patched base class once
    left AdamW without its step hooks, and the next engine's first step failed)."""
    import threading

    import torch

    from bigtrain.ds.lint import optim, schema
    inside, release = threading.Event(), threading.Event()

    class HeldScheduler:
        def __init__(self, optimizer, **params):
            assert optimizer.param_groups
            inside.set()
            release.wait(30)

    monkeypatch.setattr(schema, "scheduler_class", lambda name: HeldScheduler)
    init = torch.optim.Optimizer.__init__
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])  # AdamW's step now runs the instance's step hooks
    found: list = []
    checker = threading.Thread(target=lambda: found.append(optim.scheduler_problems({"scheduler": {"type": "X"}})))
    checker.start()
    try:
        assert inside.wait(30)
        param = torch.nn.Parameter(torch.ones(2))
        adam = torch.optim.AdamW([param], lr=0.1)
        param.grad = torch.ones(2)
        adam.step()  # the step hooks and state of a whole optimizer
        assert param.detach().tolist() != [1.0, 1.0]
    finally:
        release.set()
        checker.join(30)
    assert found == [[]] and torch.optim.Optimizer.__init__ is init
    assert optim.optimizer_problems({"optimizer": {"type": "Adagrad", "params": {"lr": -1.0}}},
                                    CPU_NO_FP16) != []  # the probe still runs torch's own argument checks
