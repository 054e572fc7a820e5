"""`bigtrain generate` and `bigtrain chat` (bigtrain/generate/) against transformers' own `generate` on the exported
directory: a tiny chat Llama fine-tuned here (in this process, one rank) and exported, then asked greedily through
every kind of TARGET (the run folder consolidated in memory, the export, the export served as a Hub model, a LoRA
run's adapter directory); prompts from a file; sampling flags; chat driven through stdin, its history and template
checked turn by turn; and the one-line errors. ZeRO-3 over 2 ranks: tests/dist/test_generate_ranks.py."""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from launch import BIN, REPO
from local_chat import conversations, make_chat_tokenizer, sentence, write_jsonl
from local_hub import FakeHub, Repo, directory_files
from messages import naming

PROMPTS = ["what is two plus two", "tell me about rivers"]
NEW = 12


@pytest.fixture(scope="module")
def made(tmp_path_factory, one_rank_group) -> dict[str, Path]:
    """{base, run, export, lora_run, lora_adapter, lora_merged, text_run, text_export}: a tiny chat Llama, fine-tuned
    3 steps in full and with LoRA on chat records, and in full on plain-text prompt/completion records, each exported
    (the LoRA run merged and as its adapter alone). A small learning rate: a few steps at a large one teach it to end
    every answer at once, and empty answers would compare equal."""
    from transformers import AutoModelForCausalLM

    from bigtrain.config.flags import build_run_parser, run_config_from_args
    from bigtrain.distributed.world import World
    from bigtrain.export import export_checkpoint
    from bigtrain.train.job import train
    from local_hf import decoder_config
    root = tmp_path_factory.mktemp("generate")
    tok = make_chat_tokenizer(root / "base")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(decoder_config("llama", len(tok))).save_pretrained(root / "base")
    data = write_jsonl(root / "chat.jsonl", conversations(48))
    rng = random.Random(1)
    text = write_jsonl(root / "text.jsonl", [{"prompt": sentence(rng, 5), "completion": " " + sentence(rng, 4)}
                                             for _ in range(48)])
    common = ["--model", "hf", "--set", f"model.pretrained={root / 'base'}", "--data", str(data), "--steps", "3",
              "--set", "precision=fp32", "--set", "data.seq_len=64", "--set", "batch.micro_batch=4",
              "--set", "batch.global_batch=4", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
              "--set", "train.eval_interval=0", "--set", "train.eval_batches=0", "--set", "optimizer.lr=1e-4",
              "--set", "data.num_proc=1", "--peak-tflops", "1"]
    for name, extra in (("run", []), ("lora_run", ["--set", "lora.r=4"]), ("text_run", ["--data", str(text)])):
        args = build_run_parser().parse_args(["--out", str(root / name), *common, *extra])
        train(run_config_from_args(args), World(0, 0, 1))
    export_checkpoint(root / "run", root / "export")
    export_checkpoint(root / "lora_run", root / "lora_merged")
    export_checkpoint(root / "lora_run", root / "lora_adapter", adapter=True)
    export_checkpoint(root / "text_run", root / "text_export")
    return {name: root / name for name in ("base", "run", "export", "lora_run", "lora_adapter", "lora_merged",
                                           "text_run", "text_export")} | {"root": root}


@functools.lru_cache(maxsize=None)
def loaded(directory: Path) -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(str(directory)).eval(), AutoTokenizer.from_pretrained(str(directory))


def reference(directory: Path, prompt: str | list[dict], template: bool = True, new: int = NEW) -> str:
    """transformers' own greedy `generate` on an exported directory, stopping where a chat turn ends."""
    model, tok = loaded(directory)
    if template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")]
    else:
        ids, eos = tok(prompt)["input_ids"], [tok.eos_token_id]
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from bigtrain.cli import main
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def completions(stdout: str) -> list[str]:
    """The completions of a generate with several prompts, by their `=== N/M: ...` headers."""
    parts, current = [], None
    for line in stdout.split("\n"):
        if line.startswith("=== "):
            if current is not None:
                parts.append("\n".join(current))
            current = []
        elif current is not None:
            current.append(line)
    parts.append("\n".join(current).removesuffix("\n"))
    return [p.removesuffix("\n") for p in parts]


def test_greedy_from_a_run_folder_equals_transformers_on_its_export(made, capsys):
    """The run folder, consolidated in memory (nothing written), answers as the export does in transformers."""
    want = [reference(made["export"], p) for p in PROMPTS]
    assert all(len(w) > 4 for w in want) and want[0] != want[1], want
    argv = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", str(NEW), "--do-sample", "false"]
    code, out, err = run_cli(["generate", str(made["run"]), *argv], capsys)
    assert code == 0 and completions(out) == want, (out, want)
    assert naming(err, "run", "checkpoint", "chat template", "greedy decoding")
    code, out, _ = run_cli(["generate", str(made["export"]), *argv], capsys)
    assert code == 0 and completions(out) == want
    assert not (made["run"] / "eval").exists() and len(list(made["root"].iterdir())) == 10  # nothing written


def test_plain_text_prompts_equal_transformers_without_a_template(made, capsys):
    code, out, err = run_cli(["generate", str(made["export"]), "--prompt", "the cat sat", "--raw",
                              "--max-new-tokens", str(NEW), "--do-sample", "false"], capsys)
    assert code == 0 and out == reference(made["export"], "the cat sat", template=False) + "\n"
    assert naming(err, "plain text (--raw)")


def test_a_plain_text_fine_tune_is_asked_in_plain_text_as_it_trained(made, capsys):
    """A chat tokenizer's model fine-tuned on plain-text prompt/completion records: `bigtrain generate` from its run
    and from its export, without --raw, asks as training did (the text alone, not the chat template) and answers as
    transformers' own `generate` does on the raw prompt; the start line says so. The chat run keeps its template."""
    model, tok = loaded(made["text_export"])
    ids = tok(PROMPTS[0])["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert len(want) > 4 and want != reference(made["text_export"], PROMPTS[0]), want  # the template would differ
    for target in ("text_run", "text_export"):
        code, printed, err = run_cli(["generate", str(made[target]), "--prompt", PROMPTS[0], "--max-new-tokens",
                                      str(NEW), "--do-sample", "false"], capsys)
        assert code == 0 and printed == want + "\n", (target, printed, want)
        assert naming(err, "prompts as plain text, as its training data asked them", "chat template is left out")
    _, _, err = run_cli(["generate", str(made["export"]), "--prompt", PROMPTS[0], "--max-new-tokens", "2"], capsys)
    assert naming(err, "prompts as its chat template")


def test_a_hub_name_and_an_adapter_directory(made, capsys, monkeypatch, tmp_path):
    from huggingface_hub import constants
    with FakeHub() as server:
        repo = Repo()
        repo.push(directory_files(made["export"]))
        server.repos["me/tiny-chat"] = repo
        for key, value in (("ENDPOINT", server.endpoint), ("HF_HUB_CACHE", str(tmp_path / "cache")),
                           ("HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"),
                           ("HF_HUB_OFFLINE", False)):
            monkeypatch.setattr(constants, key, value)
        code, out, err = run_cli(["generate", "me/tiny-chat", "--prompt", PROMPTS[0], "--max-new-tokens", str(NEW),
                                  "--do-sample", "false"], capsys)
    assert code == 0 and out == reference(made["export"], PROMPTS[0]) + "\n", err
    assert naming(err, "Hub model me/tiny-chat at commit", repo.refs["main"][:12])
    code, out, err = run_cli(["generate", str(made["lora_adapter"]), "--prompt", PROMPTS[1], "--max-new-tokens",
                              str(NEW), "--do-sample", "false"], capsys)
    assert code == 0 and out == reference(made["lora_merged"], PROMPTS[1]) + "\n", err
    assert naming(err, "peft adapter directory", "merged into its base")


def test_prompts_from_a_file_and_completions_to_a_file(made, capsys, tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    records = tmp_path / "prompts.jsonl"
    chat = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": PROMPTS[1]}]
    records.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n" + json.dumps({"messages": chat}) + "\n")
    flags = ["--max-new-tokens", str(NEW), "--do-sample", "false"]
    code, out, _ = run_cli(["generate", str(made["export"]), "--prompts-file", str(text), *flags], capsys)
    assert code == 0 and completions(out) == [reference(made["export"], p) for p in PROMPTS]
    code, out, _ = run_cli(["generate", str(made["export"]), "--prompts-file", str(records), *flags,
                            "--out", str(tmp_path / "out.jsonl")], capsys)
    want = [reference(made["export"], PROMPTS[0]), reference(made["export"], chat)]
    assert code == 0 and completions(out) == want
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert written == [{"prompt": PROMPTS[0], "completion": want[0]}, {"prompt": chat, "completion": want[1]}]


def test_sampling_flags_are_transformers_and_a_seed_repeats(made, capsys):
    base = ["generate", str(made["export"]), "--prompt", PROMPTS[0], "--max-new-tokens", "16", "--do-sample",
            "--temperature", "1.5", "--top-k", "100"]
    first = run_cli([*base, "--seed", "3"], capsys)
    again = run_cli([*base, "--seed", "3"], capsys)
    other = run_cli([*base, "--seed", "4"], capsys)
    assert first[0] == 0 and first[1] == again[1] != other[1]
    assert naming(first[2], "sampling", "temperature 1.5", "top_k 100", "16 new tokens")
    from bigtrain.generate.sampling import Sampling
    model, tok = loaded(made["export"])
    config = Sampling(max_new_tokens=5, do_sample=True, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                      num_beams=2).generation_config(model, tok, [7])
    assert (config.max_new_tokens, config.top_p, config.min_p, config.repetition_penalty, config.num_beams) == \
        (5, 0.9, 0.05, 1.2, 2) and 7 in config.eos_token_id
    # docs/generate.md's `--temperature 0.7` alone: transformers dropped it and decoded greedily (the model's
    # generation_config does not sample); a sampling value given asks for sampling
    implied = run_cli([*[a for a in base if a != "--do-sample"], "--seed", "3"], capsys)
    assert implied[0] == 0 and implied[1] == first[1] and naming(implied[2], "sampling", "temperature 1.5")
    assert Sampling(temperature=0.7).generation_config(model, tok, []).do_sample is True
    with pytest.raises(ValueError, match="--temperature with --do-sample false"):
        Sampling(temperature=0.7, do_sample=False)


def test_what_goes_wrong_is_one_line(made, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    cases = {
        "no prompt": ["generate", str(made["export"])],
        "bad.jsonl:2": ["generate", str(made["export"]), "--prompts-file", str(bad)],
        "--temperature": ["generate", str(made["export"]), "--prompt", "x", "--temperature", "0"],
        "--top-p": ["generate", str(made["export"]), "--prompt", "x", "--top-p", "1.5"],
        "no such directory": ["generate", str(tmp_path / "nowhere"), "--prompt", "x"],
        "--zero3 partitions": ["chat", str(made["export"]), "--zero3"],
        "add --zero3": ["generate", str(made["export"]), "--prompt", "x", "--num-gpus", "2"],
        "--revision": ["generate", str(made["export"]), "--prompt", "x", "--revision", "main"],
        "drop --tag": ["generate", "org/name", "--prompt", "x", "--tag", "step_000003"],
    }
    for needle, argv in cases.items():
        code, out, err = run_cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and needle in err, (needle, err)


def chat(target: Path, lines: list[str], *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(BIN / "bigtrain"), "chat", str(target), "--max-new-tokens", str(NEW), "--do-sample",
                           "false", *flags], input="".join(f"{line}\n" for line in lines), env=env,
                          capture_output=True, text=True, timeout=300)


def test_chat_through_stdin_keeps_the_history_and_resets(made):
    """Each answer is transformers' greedy answer to the whole conversation so far, rendered by the template;
    /reset starts again, /system puts a system message first; the end of input ends the chat."""
    proc = chat(made["export"], [PROMPTS[0], PROMPTS[1], "/reset", PROMPTS[1], "/system answer briefly", PROMPTS[0]])
    assert proc.returncode == 0, proc.stderr[-2000:]
    history: list[dict] = []
    want = []
    for turn in (PROMPTS[0], PROMPTS[1]):
        history.append({"role": "user", "content": turn})
        want.append(reference(made["export"], history))
        history.append({"role": "assistant", "content": want[-1]})
    want.append(reference(made["export"], PROMPTS[1]))  # after /reset: no history
    want.append(reference(made["export"], [{"role": "system", "content": "answer briefly"},
                                           {"role": "user", "content": PROMPTS[0]}]))
    assert all(len(w) > 4 for w in want), want
    assert proc.stdout == "".join(f"{w}\n" for w in want), (proc.stdout, want)
    assert want[1] != reference(made["export"], PROMPTS[1])  # the history changed the second answer
    assert naming(proc.stderr, "/reset", "Ctrl-D") and naming(proc.stderr, "system: answer briefly")
