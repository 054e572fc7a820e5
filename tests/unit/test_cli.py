"""The CLI's surface and manners: fast and quiet start, both flag spellings, the frozen verb/flag
table, hostfiles read as DeepSpeed reads them, libraries' lines in the rank's log file, loss.png and
`bigtrain plot`, `bigtrain estimate` units and pretrained directories, experiment trackers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bigtrain import cli
from launch import BIN, REPO
from messages import naming

SURFACE = Path(__file__).resolve().parents[1] / "data" / "cli_surface.json"
HEAVY = ("torch", "deepspeed", "transformers")


def run_py(code: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_building_every_verbs_parser_imports_no_torch_deepspeed_or_transformers():
    """What makes `bigtrain --help` and every verb's --help start at once (2-3 s with DeepSpeed)."""
    proc = run_py(f"""
        import importlib, json, sys
        heavy = {HEAVY!r}
        import bigtrain.cli as cli
        pulled = {{"bigtrain.cli": [m for m in heavy if m in sys.modules]}}
        for entry in cli.VERBS:
            module = entry.partition(":")[0]
            importlib.import_module(module)
            pulled[module] = [m for m in heavy if m in sys.modules]
        cli.build_parser()
        import bigtrain.run, bigtrain.config.flags
        bigtrain.config.flags.build_run_parser()
        pulled["build_run_parser, bigtrain.run"] = [m for m in heavy if m in sys.modules]
        print(json.dumps(pulled))""")
    assert proc.returncode == 0, proc.stderr[-2000:]
    pulled = json.loads(proc.stdout.splitlines()[-1])
    first = next((f"{where} imports {', '.join(mods)}" for where, mods in pulled.items() if mods), None)
    assert first is None, f"{first}: import it inside the function that needs it"


def test_help_and_version_print_nothing_from_deepspeed():
    for args in (["--help"], ["train", "--help"], ["estimate", "--help"], ["--version"]):
        start = time.perf_counter()
        proc = subprocess.run([str(BIN / "bigtrain"), *args], capture_output=True, text=True, timeout=60)
        took = time.perf_counter() - start
        print(f"bigtrain {' '.join(args)}: {took:.2f} s")
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert "accelerator" not in proc.stdout and "[WARNING]" not in proc.stdout
    assert proc.stdout.startswith("bigtrain 0.") and "deepspeed 0." in proc.stdout and "torch 2." in proc.stdout


def test_the_model_flags_help_names_every_family():
    import argparse

    from bigtrain.config.flags import build_run_parser
    from bigtrain.estimate.arguments import add_estimate_parser
    from bigtrain.models.registry import families
    verbs = argparse.ArgumentParser().add_subparsers()
    add_estimate_parser(verbs)
    for parser in (build_run_parser(), verbs.choices["estimate"]):
        helped = next(a.help for a in parser._actions if "--model" in a.option_strings)
        assert all(name in helped for name in families()), helped


def cli_surface() -> dict:
    """Verbs, their flags and positionals, and run.py's flags, from the argparse trees."""
    import argparse

    from bigtrain.config.flags import build_run_parser

    def table(parser: argparse.ArgumentParser) -> dict:  # one spelling per flag: FlagParser takes both
        flags = sorted({"--" + s[2:].replace("_", "-") for a in parser._actions for s in a.option_strings
                        if s.startswith("--")})
        positionals = [a.dest for a in parser._actions if not a.option_strings
                       and not isinstance(a, argparse._SubParsersAction)]
        return {"flags": flags, **({"positionals": positionals} if positionals else {})}

    root = cli.build_parser()
    (sub,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    return {"bigtrain": table(root), "verbs": {name: table(p) for name, p in sorted(sub.choices.items())},
            "bigtrain.run": table(build_run_parser())}


def test_cli_surface_is_frozen():
    """A verb or flag added, renamed or removed is a deliberate change: regenerate with
    BIGTRAIN_UPDATE_CLI_SURFACE=1 pytest tests/unit/test_cli.py -k surface (and say so in the README)."""
    now = cli_surface()
    if os.environ.get("BIGTRAIN_UPDATE_CLI_SURFACE"):
        SURFACE.parent.mkdir(exist_ok=True)
        SURFACE.write_text(json.dumps(now, indent=1) + "\n")
    frozen = json.loads(SURFACE.read_text())
    changes = [f"{'+' if name in now['verbs'] else '-'}verb {name}"
               for name in sorted(set(now["verbs"]) ^ set(frozen["verbs"]))]
    for where in sorted(set(now["verbs"]) & set(frozen["verbs"])):
        a, b = frozen["verbs"][where], now["verbs"][where]
        changes += [f"bigtrain {where}: {'+' if f in b['flags'] else '-'}{f}" for f in sorted(set(a["flags"]) ^ set(b["flags"]))]
        if a.get("positionals") != b.get("positionals"):
            changes.append(f"bigtrain {where}: positionals {a.get('positionals')} -> {b.get('positionals')}")
    for part in ("bigtrain", "bigtrain.run"):
        a, b = set(frozen[part]["flags"]), set(now[part]["flags"])
        changes += [f"{part}: {'+' if f in b else '-'}{f}" for f in sorted(a ^ b)]
    assert not changes, ("the CLI surface changed: " + "; ".join(changes) + ". If deliberate: "
                         "BIGTRAIN_UPDATE_CLI_SURFACE=1 pytest tests/unit/test_cli.py -k surface")


def test_every_flag_takes_both_spellings():
    import argparse

    from bigtrain.config.flags import FlagParser, build_run_parser
    root = cli.build_parser()
    (sub,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    for parser in [root, build_run_parser(), *sub.choices.values()]:
        assert isinstance(parser, FlagParser)
        for flag in [s for a in parser._actions for s in a.option_strings if s.startswith("--")]:
            for other in ("--" + flag[2:].replace("-", "_"), "--" + flag[2:].replace("_", "-")):
                # the spelling argparse knows: `other` itself where it is registered too, else `flag`
                known = other if other in parser._option_string_actions else flag
                assert parser.known_spellings([other, f"{other}=1"]) == [known, f"{known}=1"], (flag, other)
    # a spelling no parser registered stays as typed, for argparse to refuse
    assert root.known_spellings(["--no-such_flag=1", "-x"]) == ["--no-such_flag=1", "-x"]
    args, unknown = root.parse_known_args(["train", "--num_gpus", "3", "--master_port=5", "--deepspeed_config", "x.json",
                                           "--stop-after", "2", "--", "--num_gpus"])
    assert (args.num_gpus, args.master_port) == (3, 5)
    assert unknown == ["--deepspeed_config", "x.json", "--stop-after", "2", "--", "--num_gpus"]
    parsed = build_run_parser().parse_args(["--peak_tflops", "2", "--stop_after=3", "--deepspeed-config", "z.json"])
    assert (parsed.peak_tflops, parsed.stop_after, parsed.deepspeed_config) == (2.0, 3, "z.json")
    est = root.parse_args(["estimate", "--model", "gpt2", "--size", "tiny", "--num_gpus", "4", "--gpu_mem=24"])
    assert (est.num_gpus, est.gpu_mem) == (4, "24")


def test_launcher_command_and_hostfiles_read_as_deepspeed_reads_them(tmp_path):
    from deepspeed.launcher.runner import _parse_hostfile

    from bigtrain.launch.hosts import HostfileError, ranks_here, read_hostfile
    from bigtrain.launch.train import launcher_command
    text = "# cluster\nworker-1 slots=8 max_slots=8\n\nworker-2  slots=4   # the small one\nlocalhost slots=2\n"
    path = tmp_path / "hostfile"
    path.write_text(text)
    assert [(e.host, e.slots, e.line) for e in read_hostfile(path)] == [
        ("worker-1", 8, 2), ("worker-2", 4, 4), ("localhost", 2, 5)]
    assert list(_parse_hostfile(text.splitlines()).items()) == [("worker-1", 8), ("worker-2", 4), ("localhost", 2)]
    assert ranks_here(str(path)) == 2  # this node's slots
    for bad in ("worker-1 slots=x", "worker-1", "a slots=1\na slots=2"):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError):
            _parse_hostfile(bad.splitlines())  # DeepSpeed refuses what bigtrain refuses, and bigtrain names the line
        with pytest.raises(HostfileError, match=f"{path}:[12]: "):
            read_hostfile(path)
    path.write_text("localhost slots=2\n")
    cmd = launcher_command(["--size", "tiny"], None, str(path), 29500, [])
    assert cmd[1:] == ["--hostfile", str(path), "--master_port", "29500", "--log_level", "error",
                       "--module", "bigtrain.run", "--size", "tiny"]
    cmd = launcher_command(["--size", "tiny"], 2, None, None, ["--bind_cores_to_rank"], verbose=True)
    assert cmd[1:] == ["--num_gpus", "2", "--bind_cores_to_rank", "--module", "bigtrain.run", "--size", "tiny",
                       "--verbose"]
    # one machine, no launcher flag: the per-node launcher the runner would start, with the runner's own world info
    from deepspeed.launcher.runner import encode_world_info
    cmd = launcher_command(["--size", "tiny"], 3, None, 29511, [])
    assert cmd == [sys.executable, "-u", "-m", "deepspeed.launcher.launch",
                   f"--world_info={encode_world_info({'localhost': [0, 1, 2]})}", "--master_addr=127.0.0.1",
                   "--master_port=29511", "--module", "--log_level=error", "bigtrain.run", "--size", "tiny"]
    with pytest.raises(ValueError, match="does not exist"):
        launcher_command([], None, str(tmp_path / "nope"), None, [])


def test_deepspeed_lines_and_warnings_go_to_the_rank_log_file(tmp_path):
    """Routed before `import deepspeed` (whose accelerator warning is printed at import), written once
    the run directory is known; errors still reach stderr, bigtrain's own lines the console."""
    proc = run_py(f"""
        import logging, sys, warnings
        from bigtrain.metrics.logs import attach_log_file, library_stdout, route_library_logs, setup_console
        route_library_logs(console=sys.stderr)
        import deepspeed
        from deepspeed.utils import logger
        setup_console(0, True)
        warnings.warn("old API", FutureWarning)
        logger.warning("Attempting to get learning rate from scheduler before it has started")
        with library_stdout():
            print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        path = attach_log_file({str(tmp_path)!r}, 0)
        logging.getLogger("bigtrain").info("step 1/2 | loss 3.0")
        logger.error("a real error")
        print(path)""", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out_lines = proc.stdout.splitlines()
    assert out_lines[-1] == str(tmp_path / "logs" / "rank0.log") and "step 1/2 | loss 3.0" in out_lines[0]
    assert len(out_lines) == 2 and proc.stderr == "DeepSpeed ERROR: a real error\n"
    log = (tmp_path / "logs" / "rank0.log").read_text()
    for line in ("WARNING DeepSpeed] Setting accelerator to", "WARNING py.warnings] <string>:8: FutureWarning: old API",
                 "Attempting to get learning rate", "INFO DeepSpeed] DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op",
                 "INFO bigtrain] step 1/2 | loss 3.0", "ERROR DeepSpeed] a real error"):
        assert line in log, (line, log)


def write_summary(path: Path, losses: list[float], val: list[list[float]]) -> Path:
    path.mkdir(parents=True)
    summary = {"steps": len(losses), "losses": losses, "val_losses": val, "ds_config": {"train_batch_size": 8},
               "model": {"tokens_per_sample": 64}}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_loss_png_for_a_run_and_bigtrain_plot_overlays_runs(tmp_path, capsys):
    from bigtrain.metrics.plot import LossCurve, write_loss_plot
    a = write_summary(tmp_path / "a", [5.0, 4.0, 3.5, 3.0], [[2, 4.2], [4, 3.2]])
    b = write_summary(tmp_path / "b", [5.1, 4.4, 4.0, 3.9], [[4, 3.9]])
    curve = LossCurve.from_summary(json.loads((a / "summary.json").read_text()))
    assert curve.steps == [1, 2, 3, 4] and curve.val_steps == [2, 4] and (curve.per_step, curve.unit) == (512, "tokens")
    png = write_loss_plot(json.loads((a / "summary.json").read_text()), a / "loss.png")
    assert png == a / "loss.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert cli.main(["plot", str(a), str(b / "summary.json"), "--out", str(tmp_path / "both.png")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'both.png'} (2 runs)\n"
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing: no summary.json there" in err


def test_estimate_takes_bare_gigabytes_and_a_pretrained_directory(tmp_path, capsys):
    from transformers import GPT2Config

    from bigtrain.estimate.cli import parse_gpu_mem
    assert (parse_gpu_mem("80"), parse_gpu_mem(" 1.5 "), parse_gpu_mem("80GiB")) == (80 * 10**9, 1.5e9, 80 * 2**30)
    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=128).save_pretrained(tmp_path / "gpt2")
    code = cli.main(["estimate", "--model", "gpt2", "--pretrained", str(tmp_path / "gpt2"), "--gpu-mem", "16",
                     "--num-gpus", "2", "--seq-len", "128"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("gpt2 custom: ") and naming(out, "0.1M parameters", "2 ranks"), out
    assert "fits 14.90 GiB" in out
    assert f"--set model.pretrained={tmp_path / 'gpt2'}" in out
    assert cli.main(["estimate", "--model", "gpt2"]) == 2 and "--size is missing" in capsys.readouterr().err


def test_trackers_are_deepspeeds_monitors_with_the_run_config(monkeypatch, tmp_path):
    import importlib.util
    import types

    from bigtrain.config.run_config import LoggingConfig
    from bigtrain.metrics import monitor
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "COMET_API_KEY", "COMET_OFFLINE_DIRECTORY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no wandb credentials
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("wandb", "comet_ml") else real_find_spec(n, *a))
    with pytest.raises(ValueError, match=r"^logging.wandb=true needs the wandb package: pip install 'bigtrain\[wandb\]'"):
        monitor.tracker_sections(LoggingConfig(wandb=True), tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())
    sections = monitor.tracker_sections(LoggingConfig(wandb=True, comet=True, project="p"), tmp_path / "run", "run")
    assert sections == {"wandb": {"enabled": True, "project": "p", "group": "run"},
                        "comet": {"enabled": True, "project": "p", "experiment_name": "run", "online": False}}
    assert os.environ["WANDB_MODE"] == "offline" and os.environ["WANDB_DIR"] == str(tmp_path / "run")
    from deepspeed.monitor.config import get_monitor_config
    parsed = get_monitor_config(sections)  # DeepSpeed's own schema takes them
    assert parsed.wandb.enabled and parsed.comet.enabled and parsed.comet.online is False
    assert monitor.tracker_sections(LoggingConfig(), tmp_path) == {}

    updates, params = [], []
    run = types.SimpleNamespace(config=types.SimpleNamespace(update=lambda c, allow_val_change: updates.append(c)))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(run=run))
    fake = types.SimpleNamespace(wandb_monitor=types.SimpleNamespace(enabled=True),
                                 comet_monitor=types.SimpleNamespace(experiment=types.SimpleNamespace(
                                     log_parameters=params.append)))
    logger = monitor.MetricsLogger(monitor=fake, run_config={"zero": {"stage": 3}, "precision": "bf16"})
    assert updates == [{"zero": {"stage": 3}, "precision": "bf16"}]
    assert params == [{"zero.stage": 3, "precision": "bf16"}] and logger.monitor is fake


def test_bigtrain_train_on_one_machine_takes_a_free_port(monkeypatch):
    """Two jobs side by side would both take DeepSpeed's default 29500; a given --master-port is kept."""
    import socket

    from bigtrain import cli
    from bigtrain.launch import train
    started = []

    class Launched:
        pid = -1

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def wait(self):
            return 0

    monkeypatch.setattr(train.subprocess, "Popen", Launched)
    monkeypatch.setattr(train, "wait_for_session", lambda session: None)
    import signal
    handlers = [signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)]
    for extra in ([], ["--master-port", "29777"]):
        args = cli.build_parser().parse_known_args(["train", "--num-gpus", "2", "--verbose", *extra])[0]
        args.run_args = ["--size", "tiny"]
        assert train.cmd_train(args) == 0
    chosen, given = (int(next(a for a in cmd if a.startswith("--master_port=")).split("=")[1]) for cmd in started)
    assert given == 29777 and chosen != 29500
    # the launch's signal forwarding ends with it: a caller in the same process keeps its own handlers
    assert [signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)] == handlers
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", chosen))  # it was free


def test_one_rank_here_starts_without_the_deepspeed_launcher(monkeypatch):
    """One rank on this machine: `python -m bigtrain.run` itself (the launcher's two processes each import DeepSpeed
    and torch first), in the ranks' environment, its files checked by the rank (run.py) rather than imported here
    as well; a --launcher-arg, a hostfile or two ranks keep the launcher."""
    from bigtrain import cli
    from bigtrain.launch import train
    from bigtrain.train.precheck import CHECKED_ENV
    started = []

    class Launched:
        pid = -1

        def __init__(self, cmd, env, **kwargs):
            started.append((cmd, env))

        def wait(self):
            return 0

    monkeypatch.setattr(train.subprocess, "Popen", Launched)
    monkeypatch.setattr(train, "wait_for_session", lambda session: None)
    monkeypatch.setattr(train, "check_run_args", lambda args, files_here, world_size=None: "files" if files_here else None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for extra in ([], ["--launcher-arg=--bind_cores_to_rank"]):
        args = cli.build_parser().parse_known_args(["train", "--num-gpus", "1", "--verbose", *extra])[0]
        args.run_args = ["--size", "tiny"]
        assert train.cmd_train(args) == (0 if not extra else 2)  # the launcher's path checks the files here
    (cmd, env), = started
    assert cmd == [sys.executable, "-m", "bigtrain.run", "--size", "tiny", "--verbose"]
    assert env["OMP_NUM_THREADS"] == str(os.cpu_count()) and CHECKED_ENV not in env and "GLIBC_TUNABLES" in env


@pytest.mark.parametrize("launcher, forwarded, code", [(-15, [], 143), (-2, [], 130), (0, [15], 143), (0, [2], 130),
                                                       (0, [], 0), (1, [], 1), (1, [15], 1)])
def test_bigtrain_train_exits_as_the_shell_would_for_a_job_stopped_by_a_signal(launcher, forwarded, code):
    """`bigtrain train` exited 241 (sys.exit(-15)) after a SIGTERM that saved and stopped the run; a scheduler expects
    128 + 15 whether the launcher died of the signal or ended cleanly after its ranks; a rank's failure keeps its
    code."""
    from bigtrain.launch.train import exit_code
    assert exit_code(launcher, forwarded) == code


@pytest.mark.parametrize("typo, meant", [("--num_gpu", "--num-gpus"), ("--gpus", "--num-gpus"), ("--stepz", "--steps")])
def test_bigtrain_train_names_the_flag_a_typo_meant_before_any_rank_starts(monkeypatch, capsys, typo, meant):
    from bigtrain import cli
    from bigtrain.launch import train
    monkeypatch.setattr(train.subprocess, "Popen", lambda *a, **k: pytest.fail("a launcher started"))
    assert cli.main(["train", typo, "2", "--size", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == f"bigtrain: unknown argument {typo!r}; did you mean {meant}?"


@pytest.mark.parametrize("given", [["--lora.r", "8"], ["--lora.r=8"]])
def test_a_run_config_field_given_as_a_flag_is_pointed_to_set(monkeypatch, capsys, given):
    """`--lora.r 8` was answered "did you mean --local_rank?"."""
    from bigtrain import cli
    from bigtrain.launch import train
    monkeypatch.setattr(train.subprocess, "Popen", lambda *a, **k: pytest.fail("a launcher started"))
    assert cli.main(["train", *given, "--size", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == (f"bigtrain: unknown argument {given[0]!r}; a run-config field goes "
                                               "through --set: --set lora.r=8")


@pytest.mark.parametrize("argv, line", [
    (["export", "runs/x", "--output", "e"], "bigtrain export: unknown argument '--output'; did you mean --out?"),
    (["generate", "exported/x", "--promt", "hi"], "bigtrain generate: unknown argument '--promt'; did you mean --prompt?"),
    (["recipes", "cp", "llama", "x.yaml", "--forse"], "bigtrain recipes: unknown argument '--forse'; did you mean --force?"),
])
def test_a_misspelt_flag_of_any_verb_is_one_line_naming_the_nearest(capsys, argv, line):
    """`export --output` said only that --out was required, under a usage block; `generate --promt` printed the
    top-level usage."""
    from bigtrain import cli
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == line


def test_flags_a_verb_takes_in_either_spelling_or_abbreviated_are_not_misspelt():
    from bigtrain import cli
    parser = cli.build_parser()
    for argv in (["export", "runs/x", "--out", "e", "--max_shard_size", "1GB"], ["export", "runs/x", "--ou", "e"],
                 ["recipes", "cp", "llama", "x.yaml", "--force"], ["train", "--anything", "goes"]):
        assert cli.misspelt_flag_line(parser, argv) is None, argv
