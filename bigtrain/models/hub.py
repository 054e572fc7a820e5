"""A model by its Hugging Face Hub name: `org/name` (at a branch, tag or commit) -> a local directory in the Hub's
cache, wherever bigtrain takes a model directory (model.pretrained, `bigtrain eval`/`generate`/`chat` TARGET,
--tokenizer, a teacher or reward model).

The download is huggingface_hub's own `snapshot_download`: its cache (HF_HOME / HF_HUB_CACHE), token (HF_TOKEN),
offline switch (HF_HUB_OFFLINE) and resumable, content-addressed files; a file is only linked into the snapshot
once whole, and a snapshot missing a file it should hold is refused offline (huggingface_hub checks it against the
file list it cached), so nothing half-written is ever used. Only the files a run reads are fetched (config,
weights in one format, tokenizer, adapter), not a repository's other copies (`original/*.pth`, GGUF, ONNX, ...).

On many ranks (`world` given), rank 0 alone asks the Hub which commit the revision names, and every rank uses that
commit, so a branch that moves during start-up cannot give two ranks two models. On each node one process
downloads while the others of that node wait on a file lock in the cache (no collective, so no timeout however
long the download takes), then read the files it wrote. Every problem is one line naming the fix.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigtrain.atomic import write_atomic

log = logging.getLogger("bigtrain")
CONFIG = ("config.json", "generation_config.json")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
             "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "*.tiktoken", "chat_template.jinja",
             "chat_template.json")
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")
SAFETENSORS = ("model*.safetensors", "model.safetensors.index.json")
TORCH_BIN = ("pytorch_model*.bin", "pytorch_model.bin.index.json")
KINDS = ("model", "tokenizer", "config")  # what a caller reads: everything, the tokenizer only, the config only
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
SHAPES = Path(__file__).with_name("shapes")  # config.json of the Hub models the recipes name (no weights)


@dataclass(frozen=True)
class ModelSource:
    """Where a model directory came from: a local directory, or a Hub repository at a commit."""

    path: str  # the local directory (a Hub snapshot: HF_HUB_CACHE/models--ORG--NAME/snapshots/COMMIT)
    repo_id: str | None = None
    revision: str | None = None  # as asked (a branch, tag or commit); None = the repository's main
    commit: str | None = None  # what it named when resolved

    def record(self) -> dict | None:
        """What summary.json and the checkpoints keep (None for a local directory)."""
        if self.repo_id is None:
            return None
        return {"repo_id": self.repo_id, "revision": self.revision or "main", "commit": self.commit}


def is_hub_name(ref: str | None) -> bool:
    """Whether `ref` names a Hub repository (`org/name`) rather than a local directory: it is no existing path and
    has the shape of a repository id. A path that starts with / . or ~ is always a path."""
    if not ref or not isinstance(ref, str) or ref.startswith(("/", ".", "~")) or ".." in ref or "--" in ref:
        return False
    return _NAME.fullmatch(ref) is not None and not Path(ref).exists()


def resolve_model_dir(ref: str, revision: str | None = None, *, what: str = "model.pretrained", kind: str = "model",
                      world: Any = None) -> ModelSource:
    """The local directory `ref` names: a local directory as it is, or a Hub name downloaded (once per node) into
    the Hub cache at `revision` (default main). `world` (rank, local_rank, size): call it on every rank, which then
    agree on one commit. `kind`: the files wanted (KINDS). ValueError (one line) for what cannot be had."""
    assert kind in KINDS, kind
    if not is_hub_name(ref):
        path = Path(ref).expanduser()
        if revision is not None:
            raise ValueError(f"model.revision={revision!r} picks a version of a Hugging Face Hub model, and {what}="
                             f"{ref!r} is a local directory; drop model.revision")
        if not path.is_dir():
            raise ValueError(f"{what}={ref!r}: no such directory; give a local directory written by save_pretrained "
                             "(config.json, weights, tokenizer files) or a Hugging Face Hub name (org/name)")
        return ModelSource(str(path.resolve()))
    commit = _agreed_commit(ref, revision, what, world)
    with _node_lock(ref):
        path = _local_snapshot(ref, commit, kind) or _download(ref, revision, commit, kind, what)
        if not (revision and _COMMIT.fullmatch(revision)):
            _write_ref(ref, revision or "main", commit)  # what an offline run later finds the branch at
    return ModelSource(path, ref, revision, commit)


def shape_dir(ref: str, revision: str | None = None, what: str = "model.pretrained") -> str:
    """A directory with the config.json of `ref`, for what reads a model's shape only (`bigtrain estimate`, the
    recipes' memory): a local directory as it is; a Hub model whose shape bigtrain ships (bigtrain/models/shapes/
    ORG--NAME/config.json: the models the recipes name, at their main) without a download; any other Hub model's
    config.json alone, from the cache or the Hub."""
    if not is_hub_name(ref):
        return resolve_model_dir(ref, revision, what=what).path
    shipped = SHAPES / ref.replace("/", "--")
    if revision is None and (shipped / "config.json").is_file():
        return str(shipped)
    return resolve_model_dir(ref, revision, what=what, kind="config").path


def _agreed_commit(repo_id: str, revision: str | None, what: str, world: Any) -> str:
    """The commit `revision` names, asked by rank 0 alone (or this process), the same on every rank."""
    def ask() -> str:
        try:
            return json.dumps({"commit": commit_of(repo_id, revision, what)})
        except ValueError as err:  # every rank says it, no rank waits for an answer that never comes
            return json.dumps({"error": str(err)})

    if world is None or world.size == 1:
        answer = ask()
    else:
        from bigtrain.distributed.patient import from_rank0
        answer = from_rank0(ask if world.rank == 0 else None)
    found = json.loads(answer)
    if "error" in found:
        raise ValueError(found["error"])
    return found["commit"]


def commit_of(repo_id: str, revision: str | None, what: str = "model.pretrained") -> str:
    """The commit `revision` names on the Hub, or in the local cache where the Hub is not reachable (or
    HF_HUB_OFFLINE is set). One line for an unknown repository, a gated one, a revision it has not."""
    from huggingface_hub import HfApi, constants
    if revision and _COMMIT.fullmatch(revision):
        return revision
    if not constants.HF_HUB_OFFLINE:
        try:
            return HfApi().model_info(repo_id, revision=revision).sha
        except Exception as err:  # noqa: BLE001 -- the hub raises many types: each gets its one line
            if not _unreachable(err):
                raise ValueError(_hub_error_line(err, repo_id, revision, what)) from None
            reason = f"the Hub ({constants.ENDPOINT}) cannot be reached ({type(err).__name__})"
    else:
        reason = "HF_HUB_OFFLINE is set"
    ref = Path(_storage(repo_id)) / "refs" / (revision or "main")
    if ref.is_file():
        return ref.read_text().strip()
    local = f": {mistyped}; as a Hub name it" if (mistyped := mistyped_directory(repo_id)) else ""
    raise ValueError(f"{what}={repo_id!r}{_at(revision)}{local} is not in the local Hugging Face cache "
                     f"({constants.HF_HUB_CACHE}) and {reason}: download it once where the Hub is reachable "
                     f"(`hf download {repo_id}`, or a run there) into this cache (HF_HOME / HF_HUB_CACHE), or give a "
                     "local directory")


def _local_snapshot(repo_id: str, commit: str, kind: str) -> str | None:
    """The cached snapshot of `commit` when it holds every file `kind` needs (judged against the file list
    huggingface_hub cached when it downloaded it; a snapshot laid out without one is taken as it is)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    from huggingface_hub import get_cached_repo_tree
    try:
        names = [f.path for f in get_cached_repo_tree(repo_id, revision=commit)]
        patterns = wanted_files(names, kind)
    except CachedRepoTreeNotFoundError:
        patterns = None
    try:
        path = snapshot_download(repo_id, revision=commit, local_files_only=True, allow_patterns=patterns)
    except Exception:  # noqa: BLE001 -- not there, or not whole: downloaded next
        return None
    return path if Path(path, "config.json").is_file() or Path(path, ADAPTER[0]).is_file() or kind == "tokenizer" \
        else None


def _download(repo_id: str, revision: str | None, commit: str, kind: str, what: str) -> str:
    """Fetch the files `kind` needs at `commit` into the Hub cache; their snapshot folder."""
    from huggingface_hub import HfApi, constants, snapshot_download
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{what}={repo_id!r}{_at(revision)}: the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         f"holds commit {commit[:12]} incompletely and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE "
                         "to finish the download, or give a local directory")
    try:
        info = HfApi().model_info(repo_id, revision=commit, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        files = wanted_files(list(sizes), kind)
        if not files:
            raise ValueError(f"{what}={repo_id!r} holds no {kind} files bigtrain reads (config.json, safetensors or "
                             "pytorch_model.bin weights, tokenizer files); it is not a transformers model")
        _check_space(sum(sizes[f] for f in files), repo_id)
        log.info("downloading %s%s (commit %s): %d files, %.2f GB, into %s", repo_id, _at(revision), commit[:12],
                 len(files), sum(sizes[f] for f in files) / 1e9, constants.HF_HUB_CACHE)
        started = time.perf_counter()
        path = snapshot_download(repo_id, revision=commit, allow_patterns=files, tqdm_class=_bar_class())
        log.info("downloaded %s in %.0f s", repo_id, time.perf_counter() - started)
    except ValueError:
        raise
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise ValueError(_disk_line(repo_id, err)) from None
        raise ValueError(_hub_error_line(err, repo_id, revision, what)) from None
    except Exception as err:  # noqa: BLE001 -- the hub raises many types: each gets its one line
        raise ValueError(_hub_error_line(err, repo_id, revision, what)) from None
    missing = [f for f in files if not Path(path, f).is_file()]
    assert not missing, f"snapshot_download returned {path} without {missing}"
    return path


def wanted_files(names: list[str], kind: str) -> list[str]:
    """The repository files a run reads: top-level config, tokenizer and adapter files, and the weights in one
    format (safetensors where there are any, else pytorch_model*.bin); for `kind` tokenizer or config, fewer."""
    top = [n for n in names if "/" not in n]

    def matching(patterns: tuple[str, ...]) -> list[str]:
        return [n for n in top if any(fnmatch.fnmatchcase(n, p) for p in patterns)]

    if kind == "config":
        return matching(CONFIG[:1])
    if kind == "tokenizer":
        return matching(CONFIG[:1] + TOKENIZER)
    weights = matching(SAFETENSORS) or matching(TORCH_BIN)
    code = [n for n in top if n.endswith(".py")]  # a model whose code ships with it (trust_remote_code)
    return sorted(set(matching(CONFIG + TOKENIZER + ADAPTER) + weights + code))


def _check_space(needed: int, repo_id: str) -> None:
    from huggingface_hub import constants
    cache = Path(constants.HF_HUB_CACHE)
    probe = next((p for p in (cache, *cache.parents) if p.exists()), None)
    if probe is None:
        return
    have = _storage_bytes(repo_id)  # what an earlier, interrupted download left needs no new room
    free = shutil.disk_usage(probe).free
    if needed - have > free:
        raise ValueError(f"downloading {repo_id} needs {needed / 1e9:.2f} GB and the disk of the Hugging Face cache "
                         f"({cache}) has {free / 1e9:.2f} GB free: free space there, or point HF_HUB_CACHE (or "
                         "HF_HOME) at a larger disk")


def _storage_bytes(repo_id: str) -> int:
    blobs = Path(_storage(repo_id)) / "blobs"
    return sum(p.stat().st_size for p in blobs.iterdir() if p.is_file()) if blobs.is_dir() else 0


def _disk_line(repo_id: str, err: OSError) -> str:
    from huggingface_hub import constants
    return (f"the disk filled while downloading {repo_id} into {constants.HF_HUB_CACHE} ({err.strerror}): free space "
            "there, or point HF_HUB_CACHE (or HF_HOME) at a larger disk; the partial download is never used, and the "
            "next run resumes it")


def _hub_error_line(err: Exception, repo_id: str, revision: str | None, what: str) -> str:
    """One line for what the Hub answered."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.utils import get_token
    page = f"{constants.ENDPOINT}/{repo_id}"
    if isinstance(err, GatedRepoError):
        if get_token() is None:
            return (f"{what}={repo_id!r} is a gated model and no Hugging Face token is set: accept its terms at "
                    f"{page} and set HF_TOKEN (or run `hf auth login`) with a token of that account")
        return (f"{what}={repo_id!r} is a gated model and the token set (HF_TOKEN or `hf auth login`) is not granted "
                f"access: accept its terms at {page} with that token's account (access may await approval)")
    if isinstance(err, RevisionNotFoundError):
        return (f"model.revision={revision!r}: {repo_id} has no branch, tag or commit of that name; see "
                f"{page}/tree/main for its branches and commits, or drop model.revision for main")
    if isinstance(err, RepositoryNotFoundError):
        token = "" if get_token() is None else " (and your token cannot see it)"
        local = mistyped_directory(repo_id) or "no local directory of that name"
        return (f"{what}={repo_id!r}: {local}, and the Hugging Face Hub ({constants.ENDPOINT}) "
                f"has no model {repo_id!r}{token}: check the spelling (org/name, as on the model's page), or set "
                "HF_TOKEN for a private model")
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"{what}={repo_id!r}: the Hugging Face Hub answered {type(err).__name__}: {first}"


_NO_CONNECTION = {"OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError",
                  "ConnectionError"}  # by name: huggingface_hub's HTTP client (httpx, requests) varies by version


def _unreachable(err: Exception) -> bool:
    """A connection that could not be made (no network, a firewall, a Hub down), not an answer."""
    from huggingface_hub.errors import HfHubHTTPError
    if {c.__name__ for c in type(err).__mro__} & _NO_CONNECTION:
        return True
    status = getattr(getattr(err, "response", None), "status_code", None)
    return isinstance(err, HfHubHTTPError) and status is not None and status >= 500


def _storage(repo_id: str) -> str:
    from huggingface_hub import constants
    return os.path.join(constants.HF_HUB_CACHE, f"models--{repo_id.replace('/', '--')}")


def _write_ref(repo_id: str, revision: str, commit: str) -> None:
    """HF_HUB_CACHE/models--ORG--NAME/refs/REVISION = the commit, as huggingface_hub writes it (atomically), once
    the snapshot is whole: the branch as this run saw it, for a run without the Hub."""
    ref = Path(_storage(repo_id)) / "refs" / revision
    if ref.is_file() and ref.read_text().strip() == commit:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(ref, commit)


def _node_lock(repo_id: str) -> Any:
    """One process per node (per cache) downloads `repo_id`; the others wait here for as long as it takes, then
    find its files. A file lock: released by the kernel if its holder dies, so a killed download never blocks."""
    from filelock import FileLock
    from huggingface_hub import constants
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / "bigtrain" / f"models--{repo_id.replace('/', '--')}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock))


def mistyped_directory(name: str) -> str | None:
    """A Hub name whose first part is a local folder (`models/my-lama` beside `models/my-llama`) is most likely a
    mistyped local directory: say that none is there, and the folder's nearest ones. None for any other name."""
    import difflib
    folder = Path(name).parent
    if not folder.is_dir():
        return None
    near = difflib.get_close_matches(Path(name).name, sorted(p.name for p in folder.iterdir() if p.is_dir()), n=3,
                                     cutoff=0.5)
    return f"no local directory of that name ({folder}/ holds {', '.join(near)})" if near else \
        f"no local directory of that name in {folder}/"


def _at(revision: str | None) -> str:
    return f" at {revision!r}" if revision else ""


def _bar_class() -> type:
    """huggingface_hub's download bars on a terminal only (bigtrain's processes switch its own bars off, and a
    launcher's pipes would get a line per update)."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("disable", not sys.stderr.isatty())
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

    return Bar
