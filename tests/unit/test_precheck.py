"""The mistakes that need no rank, each found by the ranks' own check called before any rank starts
(bigtrain/train/precheck.py): the output folder, the data's shape and first records, the evaluation task names. The
launches themselves are tests/dist/test_precheck_runs.py; here the checks, and run.py started without a launcher."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from local_chat import make_chat_tokenizer, preference_pairs, write_jsonl
from messages import naming

from bigtrain.checkpoint import store
from bigtrain.checkpoint.claim import RunDirLock, run_dir_problem
from bigtrain.checkpoint.state import CheckpointState
from bigtrain.data.formats import ExampleOptions
from bigtrain.data.peek import PEEK_RECORDS, check_first_records, peek_source

REPO = Path(__file__).resolve().parents[2]
SEQ = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A chat tokenizer, one without a template (GPT-2's has none), and preference records right and wrong."""
    root = tmp_path_factory.mktemp("precheck")
    tok = make_chat_tokenizer(root / "chat_tok")
    tok.chat_template = None
    tok.save_pretrained(str(root / "plain_tok"))
    (root / "plain_tok" / "chat_template.jinja").unlink(missing_ok=True)
    pairs = preference_pairs(40)
    return {"root": root, "chat_tok": root / "chat_tok", "plain_tok": root / "plain_tok",
            "pairs": write_jsonl(root / "pairs.jsonl", pairs),
            "no_rejected": write_jsonl(root / "no_rejected.jsonl", [{k: v for k, v in r.items() if k != "rejected"}
                                                                  for r in pairs]),
            "same": write_jsonl(root / "same.jsonl", [dict(r, rejected=r["chosen"]) for r in pairs]),
            "same_long": write_jsonl(root / "same_long.jsonl",  # the same answers for longer than the look
                                     [dict(r, rejected=r["chosen"]) for r in preference_pairs(PEEK_RECORDS)]
                                     + preference_pairs(10, seed=1))}


def check(source: Path, tokenizer: Path | None, fmt: str = "auto") -> None:
    options = ExampleOptions(format=fmt)
    peek = peek_source(str(source), options)
    check_first_records(peek, str(tokenizer) if tokenizer else None, options, seq_len=SEQ, val_fraction=0.05,
                        text_field="text")


# -- the data ------------------------------------------------------------------------------------------------------


def test_a_record_without_rejected_names_rejected_alone(files):
    with pytest.raises(ValueError) as err:
        check(files["no_rejected"], files["chat_tok"], fmt="preference")
    line = str(err.value)
    assert naming(line, "no_rejected.jsonl line 1", "has no 'rejected'", "data.format") and "'chosen' (" not in line
    assert "no 'chosen'" not in line and "chosen, rejected" not in line


def test_records_of_no_format_against_a_pair_objective_name_the_missing_field(files):
    """format auto: records with prompt and chosen only are no format at all; dpo names what they lack."""
    from bigtrain.config.load import load_run_config
    from bigtrain.train.precheck import check_objective_data
    dpo = load_run_config(None, ["objective.kind=dpo"])
    peek = peek_source(str(files["no_rejected"]), ExampleOptions())
    assert peek.plain and peek.keys == ["prompt", "chosen"]
    with pytest.raises(ValueError) as err:
        check_objective_data(dpo, peek.layout, peek.plain, peek.keys)
    assert naming(str(err.value), "objective.kind=dpo", "no 'rejected'", "data.format")
    plain = files["root"] / "plain.txt"
    plain.write_text("the cat sat on the mat\n" * 50)
    peek = peek_source(str(plain), ExampleOptions())
    with pytest.raises(ValueError) as err:
        check_objective_data(dpo, peek.layout, peek.plain, peek.keys)
    assert naming(str(err.value), "objective.kind=dpo", "plain text", "objective.kind=lm")


def test_conversations_without_a_chat_template_name_data_chat_template(files):
    with pytest.raises(ValueError) as err:
        check(files["pairs"], files["plain_tok"])
    line = str(err.value)
    assert naming(line, "pairs.jsonl", "no chat template", "data.chat_template=FILE", str(files["plain_tok"]))
    assert "Cannot use chat template functions" not in line  # transformers' own text


def test_pairs_whose_answers_are_all_the_same_are_the_ranks_line_when_the_look_reads_the_whole_source(files):
    check(files["pairs"], files["chat_tok"])  # right records: nothing to say
    with pytest.raises(ValueError) as err:
        check(files["same"], files["chat_tok"])
    assert naming(str(err.value), "same.jsonl", "0 of 40 preference pairs", "the same tokens")
    # longer than the look: its first pairs are no verdict on the rest (the ranks count them all)
    check(files["same_long"], files["chat_tok"])


# -- the output folder ---------------------------------------------------------------------------------------------


def test_an_output_folder_held_by_a_job_or_holding_a_run_is_found_without_taking_it(tmp_path):
    out = tmp_path / "run"
    assert run_dir_problem(out, out / "checkpoints", resume=False, overwrite=False) is None
    # --resume with nothing to resume from (a mistyped --out): the ranks' line, before they start
    assert naming(run_dir_problem(out, out / "checkpoints", resume=True, overwrite=False), "--resume",
                  "no complete checkpoint", str(out / "checkpoints"), "drop --resume")
    assert not out.exists()  # looked at, not made
    held = RunDirLock()
    assert held.acquire(out) is None  # another job, running
    problem = run_dir_problem(out, out / "checkpoints", resume=False, overwrite=False)
    assert naming(problem, str(out), "in use by another bigtrain job", f"pid {os.getpid()}", "another --out")
    held.release()
    # every rank of a starting job looks at once: their looks do not stop each other
    fds = [os.open(out / ".bigtrain.lock", os.O_RDONLY) for _ in range(2)]
    import fcntl
    fcntl.flock(fds[0], fcntl.LOCK_SH | fcntl.LOCK_NB)
    assert run_dir_problem(out, out / "checkpoints", resume=False, overwrite=False) is None
    for fd in fds:
        os.close(fd)
    tag = out / "checkpoints" / "step_000004"
    tag.mkdir(parents=True)
    torch.save({"rank": 0}, tag / "rng_rank0.pt")
    store.write_marker(tag, CheckpointState(step=4, world_size=1))
    problem = run_dir_problem(out, out / "checkpoints", resume=False, overwrite=False)
    assert naming(problem, "earlier run", "step_000004", "--resume", "--overwrite")
    assert run_dir_problem(out, out / "checkpoints", resume=True, overwrite=False) is None
    assert run_dir_problem(out, out / "checkpoints", resume=False, overwrite=True) is None
    assert tag.exists()  # --overwrite deletes when the job claims the folder, never in a look
    assert naming(run_dir_problem(out, out / "checkpoints", resume=True, overwrite=True), "give one of them")


# -- evaluation tasks ----------------------------------------------------------------------------------------------


def test_task_names_are_checked_in_a_second_without_lm_evals_index(monkeypatch, tmp_path):
    pytest.importorskip("lm_eval")
    import lm_eval.tasks

    from bigtrain.eval.tasks import check_task_names

    def no_index(*args, **kwargs):
        raise AssertionError("lm-eval's index of every task file was built")

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", no_index)
    start = time.monotonic()
    check_task_names(["hellaswag", "arc_easy"], None, "train.eval_include_path")  # lm-eval's own: left to the ranks
    with pytest.raises(ValueError) as err:
        check_task_names(["hellaswagg"], None, "train.eval_include_path")
    line = str(err.value)
    assert naming(line, "unknown task 'hellaswagg'", "nearest: hellaswag", "train.eval_include_path=DIR")
    assert "--include-path" not in line  # a run's folder is a setting, not bigtrain eval's flag
    with pytest.raises(ValueError) as err:
        check_task_names(["sounds"], tmp_path / "nowhere", "train.eval_include_path")
    assert naming(str(err.value), "train.eval_include_path", "nowhere", "no such directory")
    (tmp_path / "mine.yaml").write_text("task: sounds_mc\ndataset_path: json\n")
    check_task_names(["sounds_mc"], tmp_path, "train.eval_include_path")
    with pytest.raises(ValueError) as err:
        check_task_names(["sounds_mx"], tmp_path, "--include-path")
    assert naming(str(err.value), "'sounds_mx'", "nearest: sounds_mc", "--include-path folders")
    assert time.monotonic() - start < 30  # lm-eval's index takes 8-40 s here; the look reads files only


# -- run.py, started without a launcher ------------------------------------------------------------------------------


def test_run_py_started_directly_says_the_mistake_before_its_process_group(files, tmp_path):
    """`deepspeed bigtrain/run.py` (here one process): the data's mistake before any process group, log or cache."""
    from local_hf import decoder_config
    from transformers import AutoModelForCausalLM
    model = tmp_path / "llama"
    AutoModelForCausalLM.from_config(decoder_config("llama", 400)).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (files["chat_tok"] / name).exists():
            (model / name).write_bytes((files["chat_tok"] / name).read_bytes())
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "bigtrain" / "run.py"), "--model", "hf", "--set",
                           f"model.pretrained={model}", "--data", str(files["same"]), "--set", "objective.kind=dpo",
                           "--set", f"data.seq_len={SEQ}", "--steps", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert naming(proc.stderr, "bigtrain:", "0 of 40 preference pairs", "the same tokens")
    assert "Traceback" not in proc.stderr and "ranks:" not in proc.stderr
    assert not out.exists()  # no rank log, no data cache: no process group was made



def test_files_are_checked_here_only_where_rank_0_runs(tmp_path):
    """With a hostfile, rank 0 runs on its first host: this machine's folders are rank 0's only when that is here."""
    import socket

    from bigtrain.launch.train import rank_0_here
    assert rank_0_here(None)
    (tmp_path / "here").write_text(f"{socket.gethostname()} slots=2\nworker-2 slots=2\n")
    (tmp_path / "there").write_text(f"worker-1 slots=8\n{socket.gethostname()} slots=8\n")
    assert rank_0_here(str(tmp_path / "here")) and not rank_0_here(str(tmp_path / "there"))


def test_the_data_a_family_trains_on_without_a_directory_is_its_familys():
    """The launching process reads it from models.names (no family module, no transformers model classes)."""
    from bigtrain.models.names import MODALITY
    from bigtrain.models.registry import FAMILY_MODULES, family
    assert set(MODALITY) == set(FAMILY_MODULES) - {"hf", "vlm"}  # hf, vlm: always a directory
    for name, modality in MODALITY.items():
        assert family(name).modality({}) == modality


def test_a_hub_model_is_left_to_the_ranks_that_download_it(files, tmp_path, monkeypatch):
    """model.pretrained as a Hub name (the ranks download it, bigtrain.models.hub): no false refusal here, without a
    network (its tokenizer, with its chat template, is not known before the download); the records are still read."""
    from local_chat import conversations

    from bigtrain.config.load import load_run_config
    from bigtrain.train.precheck import check_run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    chats = write_jsonl(tmp_path / "chats.jsonl", conversations(20))
    for family in ("hf", "llama"):
        run = load_run_config(None, [f"model.family={family}", "model.pretrained=some-org/some-model",
                                     f"data.source={chats}", f"train.out_dir={tmp_path / family}"])
        check_run(run)
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"messages": []}] * 3 + [{"text": "x"}])
    run = load_run_config(None, ["model.family=llama", "model.pretrained=some-org/some-model", "data.format=chat",
                                 f"data.source={broken}", f"train.out_dir={tmp_path / 'b'}"])
    with pytest.raises(ValueError) as err:
        check_run(run)
    assert naming(str(err.value), "broken.jsonl line 4", "has no 'messages'")


def test_a_mistyped_local_model_directory_is_found_before_the_launcher(files, tmp_path, monkeypatch):
    """`exported/sfft` beside `exported/sft` has a Hub name's shape, so the ranks took it for one and said so after
    the launcher's start (73 s under load, 194 s once): a Hub-shaped name under a local folder is looked up (cache or
    Hub, no download) before; the line names the folder's nearest directory."""
    from huggingface_hub import constants
    from local_chat import conversations

    from bigtrain.config.load import load_run_config
    from bigtrain.train.precheck import check_run
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    (tmp_path / "exported" / "sft").mkdir(parents=True)
    chats = write_jsonl(tmp_path / "chats.jsonl", conversations(20))
    run = load_run_config(None, ["model.family=hf", "model.pretrained=exported/sfft", f"data.source={chats}",
                                 f"train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError) as err:
        check_run(run)
    assert naming(str(err.value), "exported/sfft", "no local directory", "exported/ holds sft"), err.value
    assert not (tmp_path / "run").exists()


def test_reward_files_are_read_before_the_launcher_without_being_imported(tmp_path, monkeypatch):
    """objective.rewards=rewards.py:exactt (or reward.py:exact) was the ranks' line after the launcher's start
    (154-222 s under load): the file, its syntax and the name are checked here, from its text: a file whose import
    would fail (or load a model) is not run, and names made at run time are left to the ranks."""
    from bigtrain.config.load import load_run_config
    from bigtrain.train.precheck import check_run
    monkeypatch.chdir(tmp_path)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"say {i}", "answer": str(i)} for i in range(10)])
    (tmp_path / "rewards.py").write_text(
        "import missing_package_that_would_fail_on_import\n"
        "def exact(completions, answer, **kwargs):\n    return [1.0] * len(completions)\n"
        "def _helper():\n    pass\n"
        "if True:\n    def starts_right(completions, **kwargs):\n        return [0.0] * len(completions)\n"
        "try:\n    import re as regex\nexcept ImportError:\n    regex = None\n"
        "scaled = lambda completions, **kwargs: [0.5] * len(completions)\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "star.py").write_text("from rewards import *\n")

    def line(*rewards: str) -> str | None:
        run = load_run_config(None, ["objective.kind=grpo", "objective.rewards=[" + ",".join(f'"{r}"' for r in rewards) + "]",
                                     "objective.max_completion_length=4", "data.seq_len=16", "model.family=llama",
                                     "model.size=tiny", "data.tokenizer=byte", f"data.source={prompts}",
                                     f"train.out_dir={tmp_path / 'run'}"])
        try:
            check_run(run)
        except ValueError as err:
            return str(err)
        return None

    assert naming(line("rewards.py:exactt"), "'rewards.py:exactt'", "has no 'exactt'", "exact, starts_right")
    assert "_helper" not in line("rewards.py:exactt")
    assert naming(line("accuracy", "reward.py:exact"), "no such file reward.py")
    assert naming(line("broken.py:f"), "broken.py does not import", "SyntaxError", "line 1")
    assert naming(line("rewards.py"), "give path/to/file.py:function")
    for fine in ("rewards.py:exact", "rewards.py:starts_right", "rewards.py:scaled", "rewards.py:regex",
                 "star.py:exact", "some_package.module:fn", "accuracy", "length=4,2"):
        assert line(fine) is None, fine
    assert not (tmp_path / "run").exists()


def test_weights_without_a_tokenizer_are_refused_before_a_bpe_is_trained_for_them(files, tmp_path):
    """A model folder copied without its tokenizer files got a BPE trained on the corpus and fine-tuned on ids its
    weights never saw, exit 0: now one line naming the folder and data.tokenizer, before the launcher; a folder of
    config alone (random weights) still trains its own."""
    from transformers import LlamaConfig

    from bigtrain.config.load import load_run_config
    from bigtrain.train.precheck import check_run
    model = tmp_path / "copied"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=300).save_pretrained(model)
    text = tmp_path / "corpus.txt"
    text.write_text("some text to train a tokenizer on\n" * 50)
    flags = ["model.family=hf", f"model.pretrained={model}", f"data.source={text}", f"train.out_dir={tmp_path / 'r'}"]
    check_run(load_run_config(None, flags))  # config alone: random weights, a BPE of its own is right
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        check_run(load_run_config(None, flags))
    assert naming(str(err.value), str(model), "no tokenizer", "data.tokenizer="), err.value
    assert not (tmp_path / "r").exists()


def test_a_teacher_or_reward_model_that_is_not_one_is_named_by_its_own_setting(tmp_path):
    """A missing teacher was reported as model.pretrained (the student, which existed); a causal LM given as the
    reward model trained against a head of random weights, exit 0."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from bigtrain.config.load import load_run_config
    from bigtrain.train.precheck import check_frozen_models
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=300)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path / "lm")

    def line(*sets: str) -> str:
        with pytest.raises(ValueError) as err:
            check_frozen_models(load_run_config(None, ["data.seq_len=64", "objective.max_completion_length=16", *sets]))
        return str(err.value)

    assert naming(line("objective.kind=distill", f"objective.teacher={tmp_path / 'nosuch'}"),
                  "objective.teacher=", "nosuch", "no such directory")
    grpo = ["objective.kind=grpo", "objective.rewards=length"]
    assert naming(line(*grpo, f"objective.reward_model={tmp_path / 'lm'}"), "objective.reward_model=",
                  "LlamaForCausalLM", "not a reward model", "one label")
    config.num_labels, config.architectures = 3, ["LlamaForSequenceClassification"]
    config.save_pretrained(tmp_path / "three")
    assert naming(line(*grpo, f"objective.reward_model={tmp_path / 'three'}"), "3 labels", "num_labels=1")
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    check_frozen_models(load_run_config(None, ["data.seq_len=64", "objective.max_completion_length=16", *grpo,
                                               f"objective.reward_model={tmp_path / 'rm'}"]))
