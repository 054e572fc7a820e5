"""Models by their Hub names (bigtrain.models.hub), without a network: a cache laid out by hand as huggingface_hub
lays it out, and a Hub served by a local HTTP server (tests/local_hub.py) that huggingface_hub's real download path
talks to through HF_ENDPOINT: the commit a branch names, only the files a run reads, once per node, and one line
for each thing that goes wrong."""
from __future__ import annotations

import json
import multiprocessing
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import REPO
from local_hub import FakeHub, Repo, directory_files, lay_out_cache, resolve_in_child
from messages import naming

from bigtrain.models import hub


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama with a chat tokenizer, as save_pretrained writes it."""
    from transformers import AutoModelForCausalLM

    from local_chat import make_chat_tokenizer
    from local_hf import decoder_config
    root = tmp_path_factory.mktemp("tiny")
    tok = make_chat_tokenizer(root)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(decoder_config("llama", len(tok))).save_pretrained(root)
    return root


def hub_env(monkeypatch, cache: Path, endpoint: str = "http://127.0.0.1:9", offline: bool = False,
            token: str | None = None) -> None:
    """huggingface_hub's settings as HF_ENDPOINT / HF_HUB_CACHE / HF_HUB_OFFLINE / HF_TOKEN would make them (it reads
    them at import; a user sets them before)."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cache / "no-token"))
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HF_TOKEN", token)


def repo_of(directory: Path, **extra: bytes) -> Repo:
    repo = Repo()
    repo.push({**directory_files(directory), **extra})
    return repo


def test_what_is_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_name("meta-llama/Llama-3.1-8B") and hub.is_hub_name("Qwen/Qwen3-8B")
    (tmp_path / "runs" / "x").mkdir(parents=True)
    assert not hub.is_hub_name("runs/x")  # an existing path is a path
    for path in ("/models/llama", "./llama", "~/llama", "../a/b", "llama", "a/b/c", "org/na--me", None, ""):
        assert not hub.is_hub_name(path), path


def test_a_cache_laid_out_as_huggingface_hub_lays_it_out_is_used_offline(tmp_path, monkeypatch, tiny_dir):
    hub_env(monkeypatch, tmp_path / "cache", offline=True)
    files = directory_files(tiny_dir)
    main = lay_out_cache(tmp_path / "cache", "org/tiny", files, commit="a" * 40)
    tagged = lay_out_cache(tmp_path / "cache", "org/tiny", {**files, "README.md": b"v1"}, commit="b" * 40,
                           branch="v1")
    found = hub.resolve_model_dir("org/tiny")
    assert (found.path, found.repo_id, found.commit) == (str(main), "org/tiny", "a" * 40)
    assert found.record() == {"repo_id": "org/tiny", "revision": "main", "commit": "a" * 40}
    assert hub.resolve_model_dir("org/tiny", "v1").path == str(tagged)
    assert hub.resolve_model_dir("org/tiny", "b" * 40).path == str(tagged)
    from bigtrain import models
    spec = models.build("hf", "custom", pretrained=found.path)  # the snapshot is a model directory like any
    assert spec.pretrained == found.path and spec.num_params > 0
    assert hub.resolve_model_dir(str(tiny_dir)).record() is None  # a local directory stays one


def test_the_real_download_path_against_a_local_endpoint(tmp_path, monkeypatch, tiny_dir):
    """huggingface_hub's snapshot_download, through HTTP: the commit main names, only the files a run reads (not
    a repository's other weight copies), nothing fetched twice, the cache then enough offline, a moved branch."""
    with FakeHub() as server:
        repo = repo_of(tiny_dir, **{"pytorch_model.bin": b"a second copy of the weights",
                                    "original/consolidated.00.pth": b"Meta's own checkpoint", "README.md": b"card"})
        first = repo.refs["main"]
        server.repos["org/tiny"] = repo
        hub_env(monkeypatch, tmp_path / "cache", server.endpoint)
        found = hub.resolve_model_dir("org/tiny")
        assert found.commit == first and Path(found.path).name == first
        wanted = set(directory_files(tiny_dir))  # config, weights, tokenizer and its chat template
        assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= wanted
        assert set(repo.served) == wanted, repo.served  # no .bin, no original/, no README
        assert sorted(repo.served) == sorted(set(repo.served))  # each file once
        assert {p.name for p in Path(found.path).iterdir()} == wanted
        assert (Path(found.path) / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
        served = len(repo.served)
        assert hub.resolve_model_dir("org/tiny").path == found.path and len(repo.served) == served  # cached

        second = repo.push({**directory_files(tiny_dir), "config.json": (tiny_dir / "config.json").read_bytes()
                            .replace(b'"rms_norm_eps": 1e-06', b'"rms_norm_eps": 1e-05')})
        assert hub.resolve_model_dir("org/tiny").commit == second  # main moved
        assert hub.resolve_model_dir("org/tiny", first).path == found.path  # a commit stays what it was
        hub_env(monkeypatch, tmp_path / "cache", server.endpoint, offline=True)
        assert hub.resolve_model_dir("org/tiny").commit == second  # offline: the cache's refs/main
        tokenizer = hub.resolve_model_dir("org/tiny", kind="tokenizer")
        assert Path(tokenizer.path, "tokenizer.json").is_file()


def test_what_goes_wrong_is_one_line(tmp_path, monkeypatch, tiny_dir):
    with FakeHub() as server:
        server.repos["org/tiny"] = repo_of(tiny_dir)
        server.repos["org/gated"] = repo_of(tiny_dir)
        server.repos["org/gated"].gated_token = "hf_granted"
        hub_env(monkeypatch, tmp_path / "cache", server.endpoint)
        lines = {}
        for name, call in {
            "unknown": lambda: hub.resolve_model_dir("org/tinny"),
            "revision": lambda: hub.resolve_model_dir("org/tiny", "v9"),
            "gated": lambda: hub.resolve_model_dir("org/gated"),
            "local_revision": lambda: hub.resolve_model_dir(str(tiny_dir), "main"),
            "no_dir": lambda: hub.resolve_model_dir(str(tmp_path / "nowhere")),
        }.items():
            with pytest.raises(ValueError) as err:
                call()
            lines[name] = str(err.value)
        hub_env(monkeypatch, tmp_path / "cache", server.endpoint, token="hf_someone_else")
        with pytest.raises(ValueError) as err:
            hub.resolve_model_dir("org/gated")
        lines["gated_token"] = str(err.value)
    hub_env(monkeypatch, tmp_path / "cache", "http://127.0.0.1:9")  # nothing listens: no network
    with pytest.raises(ValueError) as err:
        hub.resolve_model_dir("org/tiny")
    lines["unreachable"] = str(err.value)
    hub_env(monkeypatch, tmp_path / "cache", offline=True)
    with pytest.raises(ValueError) as err:
        hub.resolve_model_dir("org/tiny")
    lines["offline"] = str(err.value)
    assert all("\n" not in line for line in lines.values()), lines
    assert naming(lines["unknown"], "org/tinny", "no model", "HF_TOKEN")
    assert naming(lines["revision"], "model.revision='v9'", "org/tiny", "no branch, tag or commit")
    assert naming(lines["gated"], "gated", "no Hugging Face token", "HF_TOKEN", "/org/gated")
    assert naming(lines["gated_token"], "gated", "not granted access")
    assert naming(lines["local_revision"], "model.revision", "local directory")
    assert naming(lines["no_dir"], "no such directory", "Hub name")
    for key in ("unreachable", "offline"):
        assert naming(lines[key], "org/tiny", "not in the local Hugging Face cache", str(tmp_path / "cache")), key
    assert naming(lines["unreachable"], "cannot be reached") and naming(lines["offline"], "HF_HUB_OFFLINE")


def test_a_disk_that_fills_mid_download_leaves_nothing_used_later(tmp_path, tiny_dir):
    """A download cut by a full disk (RLIMIT_FSIZE: writes past it fail as a full disk's do) is one line; the
    snapshot it left is never taken for a model (offline: refused as incomplete), and the next run completes it."""
    with FakeHub() as server:
        server.repos["org/tiny"] = repo_of(tiny_dir)
        env = {**os.environ, "HF_ENDPOINT": server.endpoint, "HF_HUB_CACHE": str(tmp_path / "cache"),
               "HF_TOKEN_PATH": str(tmp_path / "none"), "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(REPO)}
        code = ("import os, sys\nfrom bigtrain.models.hub import resolve_model_dir\ntry:\n"
                "    print(resolve_model_dir('org/tiny', os.environ.get('REV')).path)\nexcept ValueError as e:\n"
                "    print(e, file=sys.stderr); sys.exit(2)")
        limit = (tiny_dir / "model.safetensors").stat().st_size // 2

        def run(**more: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", code], env={**env, **more}, capture_output=True, text=True,
                                  timeout=120, preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (
                                      limit, limit))) if more.pop("limited", None) else None)

        cut = run(limited="1")
        assert cut.returncode == 2, cut.stderr[-2000:]
        assert cut.stderr.count("\n") == 1 and naming(cut.stderr, "disk filled", "org/tiny", "HF_HUB_CACHE"), cut.stderr
        offline = run(HF_HUB_OFFLINE="1")  # main was never whole here: no branch recorded
        assert offline.returncode == 2 and naming(offline.stderr, "not in the local", "HF_HUB_OFFLINE"), offline.stderr
        offline = run(HF_HUB_OFFLINE="1", REV=server.repos["org/tiny"].refs["main"])  # its commit: half there
        assert offline.returncode == 2 and naming(offline.stderr, "incompletely", "HF_HUB_OFFLINE"), offline.stderr
        done = run()
        assert done.returncode == 0, done.stderr[-2000:]
        path = Path(done.stdout.strip())
        assert (path / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_a_disk_too_small_is_said_before_downloading(tmp_path, monkeypatch, tiny_dir):
    with FakeHub() as server:
        repo = repo_of(tiny_dir)
        server.repos["org/tiny"] = repo
        hub_env(monkeypatch, tmp_path / "cache", server.endpoint)
        real = hub.shutil.disk_usage
        monkeypatch.setattr(hub.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
        with pytest.raises(ValueError) as err:
            hub.resolve_model_dir("org/tiny")
        assert naming(str(err.value), "needs", "GB free", "HF_HUB_CACHE") and not repo.served


def test_one_process_per_node_downloads(tmp_path, tiny_dir):
    """Three processes ask at once (as a node's ranks do): the file lock lets one download; the others wait for it
    and find its files in the cache without asking the Hub about them (one file listing, one look at each file:
    without the lock each process lists and looks itself, though huggingface_hub's own per-file locks keep the
    bytes from being fetched twice either way)."""
    with FakeHub() as server:
        repo = repo_of(tiny_dir)
        server.repos["org/tiny"] = repo
        server.body_delay = 0.4  # each file takes a while: the three overlap
        with multiprocessing.get_context("spawn").Pool(3) as pool:
            paths = pool.map(resolve_in_child, [(server.endpoint, str(tmp_path / "cache"), "org/tiny")] * 3)
        assert len(set(paths)) == 1
        assert sorted(repo.served) == sorted(set(repo.served)) and "model.safetensors" in repo.served, repo.served
        looks = [r for r in server.requests if r.startswith("HEAD ") or "/tree/" in r]
        assert len(looks) == len(repo.served) + 1 and len(set(looks)) == len(looks), looks


def test_the_files_a_run_reads():
    names = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "original/params.json",
             "original/consolidated.00.pth", "README.md", ".gitattributes", "LICENSE", "model.gguf",
             "onnx/model.onnx", "flax_model.msgpack", "tf_model.h5", "chat_template.jinja", "modeling_x.py"]
    assert hub.wanted_files(names, "model") == sorted(
        ["config.json", "generation_config.json", "model-00001-of-00002.safetensors", "chat_template.jinja",
         "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json", "modeling_x.py"])
    assert "pytorch_model.bin" in hub.wanted_files(["config.json", "pytorch_model.bin"], "model")  # no safetensors
    assert hub.wanted_files(names, "config") == ["config.json"]
    assert "model-00001-of-00002.safetensors" not in hub.wanted_files(names, "tokenizer")


def test_a_run_config_with_a_revision_and_no_model():
    from bigtrain.config.load import load_run_config
    with pytest.raises(ValueError) as err:
        load_run_config(None, ["model.revision=main"])
    assert naming(str(err.value), "model.revision", "model.pretrained")
    run = load_run_config(None, ["model.family=hf", "model.pretrained=org/name", "model.revision=v1"])
    assert (run.model.pretrained, run.model.revision, run.model.size) == ("org/name", "v1", "custom")
    assert json.loads(json.dumps(run.model.__dict__))["revision"] == "v1"


def test_eval_and_generate_take_a_hub_target(tmp_path):
    """A Hub name is a TARGET of its own kind, passed to launched ranks as it is (not made a path)."""
    import argparse

    from bigtrain.eval.target import target_kind
    from bigtrain.launch.eval import rank_args as eval_rank_args
    from bigtrain.launch.generate import rank_args as generate_rank_args
    assert target_kind("org/tiny") == "hub"
    with pytest.raises(ValueError) as err:
        target_kind("org/tiny", tag="step_000001")
    assert naming(str(err.value), "--tag", "Hub model")
    args = argparse.Namespace(target="org/tiny", tasks="a", batch_size=8, include_path=[], num_fewshot=None,
                              limit=None, tag=None, tokenizer=None, out=None, revision="v1", trust_checkpoint=False,
                              zero3=True)
    assert eval_rank_args(args)[0] == "org/tiny" and "--revision" in eval_rank_args(args)
    from bigtrain.cli import build_parser
    parsed = build_parser().parse_args(["chat", "org/tiny", "--revision", "v1", "--zero3", "--num-gpus", "2",
                                        "--do-sample", "false", "--system", "be brief"])
    ranks = generate_rank_args(parsed)
    assert ranks[:4] == ["--mode", "chat", "org/tiny", "--zero3"]
    assert ranks[ranks.index("--do-sample") + 1] == "false" and ranks[ranks.index("--system") + 1] == "be brief"
    from bigtrain.generate.flags import build_rank_parser
    rank = build_rank_parser().parse_args(["--local_rank=1", *ranks])  # what a launched rank reads back
    assert (rank.mode, rank.target, rank.revision, rank.do_sample, rank.system, rank.zero3) == \
        ("chat", "org/tiny", "v1", False, "be brief", True)


def test_a_mistyped_local_directory_is_named_as_one(tmp_path, monkeypatch, tiny_dir):
    """`models/my-lama` beside `models/my-llama` has a Hub name's shape: the line says no such local directory is
    there and names the nearest one, offline, unreachable or answered by the Hub, not only the Hub's cache."""
    import shutil
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dir, tmp_path / "models" / "my-llama")
    hub_env(monkeypatch, tmp_path / "cache", offline=True)
    lines = {}
    with pytest.raises(ValueError) as err:
        hub.resolve_model_dir("models/my-lama")
    lines["offline"] = str(err.value)
    hub_env(monkeypatch, tmp_path / "cache")  # nothing listens: no network
    with pytest.raises(ValueError) as err:
        hub.resolve_model_dir("models/my-lama")
    lines["unreachable"] = str(err.value)
    with FakeHub() as server:
        hub_env(monkeypatch, tmp_path / "cache", server.endpoint)
        with pytest.raises(ValueError) as err:
            hub.resolve_model_dir("models/my-lama")
        lines["unknown"] = str(err.value)
        with pytest.raises(ValueError) as err:
            hub.resolve_model_dir("org/tinny")  # no local folder org/: the Hub's line alone
        lines["hub_only"] = str(err.value)
    for key in ("offline", "unreachable", "unknown"):
        assert naming(lines[key], "models/my-lama", "no local directory", "models/ holds my-llama"), lines[key]
    assert naming(lines["unknown"], "no model 'models/my-lama'")
    assert naming(lines["hub_only"], "no local directory of that name", "no model 'org/tinny'")
    assert all("\n" not in line for line in lines.values()), lines
