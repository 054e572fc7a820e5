"""Tokenizers: a local directory or hub name, or a byte-level BPE trained on the corpus.

The trained BPE is saved as a Hugging Face tokenizer directory (beside the checkpoints),
so `AutoTokenizer.from_pretrained(dir)` loads it for the exported model, and a resumed
run reuses it instead of training a new one. Training is deterministic for a given
corpus order and vocab_size, so a trained BPE is also kept in a machine-wide cache keyed by
the text it was trained on (`trained_cache`): the next run on the same corpus (a new --out, a
sweep, the next job of a test) copies it instead of training for seconds to minutes again.
Multi-rank pattern: the writer rank calls `ensure_tokenizer`, all ranks meet at a barrier,
then every rank calls `load_tokenizer`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bigtrain.machine_cache import cache_root

EOS = "<|endoftext|>"  # GPT-2's document separator; also bos/unk/pad of the trained BPE
MIN_VOCAB = 257  # 256 byte symbols + EOS
MIN_FREQUENCY = 2  # a pair seen once is not merged


def has_tokenizer(directory: Path) -> bool:
    """Whether `directory` already holds a saved tokenizer."""
    return (Path(directory) / "tokenizer.json").is_file() or (Path(directory) / "tokenizer_config.json").is_file()


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE (GPT-2 style) with at most `vocab_size` tokens, EOS included."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"data.vocab_size={vocab_size}: a byte-level BPE needs at least {MIN_VOCAB} "
                         "(256 bytes + end of text); use e.g. 4096")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, special_tokens=[EOS],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS,
                                   unk_token=EOS, pad_token=EOS)


def ensure_tokenizer(directory: Path, texts: Callable[[], Iterable[str]], vocab_size: int) -> Path:
    """Train and save a BPE into `directory` unless one is there already. Idempotent.

    `texts` is called only when training is needed. The save goes to a temporary directory
    renamed into place, so a reader never sees half a tokenizer and two writers cannot mix.
    """
    directory = Path(directory)
    if has_tokenizer(directory):
        return directory
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"tokenizer directory {directory} exists and holds other files but no tokenizer; "
                         "point it at an empty or new directory")
    cached = trained_cache(texts, vocab_size)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    if cached is not None and has_tokenizer(cached):
        shutil.copytree(cached, tmp)
    else:
        train_bpe(texts(), vocab_size).save_pretrained(str(tmp))
        if cached is not None:
            _keep(tmp, cached)
    try:
        os.replace(tmp, directory)  # atomic; succeeds over an empty directory
    except OSError:
        if not has_tokenizer(directory):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another writer won the race with the same result
    return directory


def trained_cache(texts: Callable[[], Iterable[str]], vocab_size: int) -> Path | None:
    """Where the BPE of `vocab_size` trained on exactly these texts is kept (None: no cache). The key is a hash of
    every text in order, the vocabulary size and the tokenizers version, so another corpus, a corpus edited since,
    or another trainer never reads it; hashing reads the text once more (about 1 s per 500 MB)."""
    root = cache_root()
    if root is None:
        return None
    import tokenizers
    trainer = f"byte-level-bpe min_frequency={MIN_FREQUENCY} {EOS} {vocab_size} {tokenizers.__version__}"
    digest = hashlib.sha256(trainer.encode())
    for text in texts():
        digest.update(len(text).to_bytes(8, "little"))
        digest.update(text.encode("utf-8", "surrogatepass"))
    return root / "tokenizers" / digest.hexdigest()[:32]


def _keep(trained: Path, cached: Path) -> None:
    """Copy a trained tokenizer into the cache, whole or not at all; a cache that cannot be written (a read-only
    or full home) costs the next run a training, nothing more."""
    tmp = cached.parent / f".{cached.name}.tmp-{os.getpid()}"
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(trained, tmp)
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(name_or_dir: str | Path, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer from a local directory, or from the hub (from the local HF cache when offline); `chat_template`
    (data.chat_template: a file or the template) in place of its own."""
    from bigtrain.data.sources import hub_reachable

    path = Path(name_or_dir).expanduser()
    if path.exists():
        if not has_tokenizer(path):
            raise ValueError(f"data.tokenizer={str(name_or_dir)!r}: the directory holds no tokenizer "
                             "(tokenizer.json / tokenizer_config.json)")
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(name_or_dir), local_files_only=not hub_reachable())
        except (OSError, ValueError) as e:
            raise ValueError(f"data.tokenizer={str(name_or_dir)!r}: not a local directory and not loadable from "
                             f"the hub or the local HF cache ({type(e).__name__}); give a tokenizer directory, "
                             "or leave data.tokenizer unset to train a BPE on the corpus") from e
    if tokenizer.pad_token is None:  # GPT-2's tokenizer has none; padding only fills classification inputs
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.sep_token
    if chat_template:
        from bigtrain.data.chat import read_chat_template
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def resolve_tokenizer(name: str | None, directory: Path, vocab_size: int, texts: Callable[[], Iterable[str]],
                      is_writer: bool, barrier: Callable[[], None]) -> PreTrainedTokenizerBase:
    """The run's tokenizer: the named one, or the BPE in `directory` (trained there by the writer)."""
    if name is not None:
        return load_tokenizer(name)
    if is_writer:
        ensure_tokenizer(directory, texts, vocab_size)
    barrier()
    tokenizer = load_tokenizer(directory)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer saved in {directory} has {len(tokenizer)} tokens but data.vocab_size="
                         f"{vocab_size}; set data.vocab_size >= {len(tokenizer)} or delete {directory} to retrain")
    return tokenizer


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id put between packed documents."""
    for token_id in (tokenizer.eos_token_id, tokenizer.sep_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no end-of-text or separator token to put "
                     "between documents; use a tokenizer that has one")


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads a row of one example (pairs, KTO's answers, classification texts), and that a model whose
    head reads a row's last token (a reward model, a decoder classifier) is told to skip (config.pad_token_id):
    the tokenizer's own pad, else its end-of-text (TRL's fallback; `load_tokenizer` sets the same), so that a
    user's batch, padded by the tokenizer, reads each conversation where training read it."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return eos_id(tokenizer)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the tokenizer's full definition, for cache keys."""
    if tokenizer.is_fast:
        text = tokenizer.backend_tokenizer.to_str()
    else:
        text = repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
