"""Training data: local text / JSONL / Parquet files, tokenised, packed into fixed-length sequences, and a
deterministic sampler sharded over the data-parallel ranks only, whose position is just the step number.

Packing: documents are tokenised, each followed by an end-of-text id, concatenated into one stream and cut
into `seq`-token samples (the tail that does not fill a sample is dropped). Causal-LM labels are the inputs
(the model shifts them). Sampling: epoch e visits the samples in `torch.randperm(n, seed + e)` order; optimizer
step s takes global positions [s * batch, (s + 1) * batch) of the concatenated epochs, and data-parallel rank r
of n takes the r-th contiguous slice of batch / n of those. So a resumed run that knows its step reads exactly
what the uninterrupted run read, for any world size with the same batch.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import RunError

logger = logging.getLogger(__name__)

SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".parquet")
BYTE_EOS_ID = 0  # NUL never occurs in text: the byte tokenizer's document separator


# ------------------------------------------------------------------------------------------- reading
def list_files(paths: list[str]) -> list[Path]:
    """The data files named by `paths` (files, or directories searched recursively for SUFFIXES), sorted.
    Raises RunError naming a path that does not exist or a directory without data files."""
    files: list[Path] = []
    for text in paths:
        p = Path(text)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
            if not found:
                raise RunError(f"treadle.run: data directory {text!r} holds no {'/'.join(SUFFIXES)} files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise RunError(f"treadle.run: data path {text!r} does not exist")
    return files


def read_documents(path: Path, *, text_field: str = "text") -> list[str]:
    """The documents of one file: a text file is one document; JSONL gives `text_field` of each line; Parquet
    the `text_field` column (needs pyarrow). Raises RunError naming the file (and line) for malformed input:
    bad JSON, JSON nested too deeply to parse, text that is not UTF-8, a file that is not Parquet, or one the
    operating system cannot read."""
    try:
        return _read_documents(path, text_field=text_field)
    except UnicodeDecodeError as exc:
        raise RunError(f"treadle.run: {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise RunError(f"treadle.run: cannot read data file {path}: {exc.strerror or exc}") from None


def _read_documents(path: Path, *, text_field: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        docs = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunError(f"treadle.run: {path}:{i}: not a JSON line ({exc.msg})") from None
            except RecursionError:
                raise RunError(f"treadle.run: {path}:{i}: JSON nested too deeply to read (more than about "
                               f"{sys.getrecursionlimit()} levels); a document is an object with a "
                               f"{text_field!r} string") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise RunError(f"treadle.run: {path}:{i}: no string field {text_field!r} "
                               f"(set --text-field); keys: {sorted(row) if isinstance(row, dict) else type(row).__name__}")
            docs.append(row[text_field])
        return docs
    if suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise RunError(f"treadle.run: {path} is Parquet; install pyarrow to read it") from None
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:  # ArrowInvalid: not Parquet, truncated, bad footer
            raise RunError(f"treadle.run: {path} is not a readable Parquet file: {exc}") from None
        if text_field not in table.column_names:
            raise RunError(f"treadle.run: {path}: no column {text_field!r}; columns: {table.column_names}")
        values = table.column(text_field).to_pylist()
        bad = next((i for i, t in enumerate(values) if t is not None and not isinstance(t, str)), None)
        if bad is not None:
            raise RunError(f"treadle.run: {path}: column {text_field!r} holds {type(values[bad]).__name__} at row "
                           f"{bad}, not text; set --text-field to a string column")
        return [t for t in values if t]
    return [path.read_text(encoding="utf-8", errors="replace")]


# ------------------------------------------------------------------------------------------- tokenizing
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 0 (NUL) ends a document."""

    vocab_size = 256
    eos_id = BYTE_EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the `tokenizers` library; no network, no code)."""

    def __init__(self, path: str):
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise RunError(f"treadle.run: tokenizer {path!r}: no tokenizer.json there")
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(file))
        self.vocab_size = self.tok.get_vocab_size()
        eos = None
        for name in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"):
            eos = self.tok.token_to_id(name)
            if eos is not None:
                break
        self.eos_id = eos if eos is not None else 0

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def make_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    return HFTokenizer(path) if path else ByteTokenizer()


# ------------------------------------------------------------------------------------------- packing
def pack(paths: list[str], *, seq: int, tokenizer: ByteTokenizer | HFTokenizer, text_field: str = "text",
         vocab_size: int | None = None) -> torch.Tensor:
    """All documents of `paths`, tokenised and packed: (n_samples, seq) int64.

    Raises RunError for a missing path, an empty file, fewer than `seq` tokens in all, or a token id the
    model's embedding (`vocab_size`) cannot take."""
    ids: list[int] = []
    for f in list_files(paths):
        docs = read_documents(f, text_field=text_field)
        if not any(d.strip() for d in docs):
            raise RunError(f"treadle.run: data file {str(f)!r} is empty")
        for d in docs:
            ids += tokenizer.encode(d)
            ids.append(tokenizer.eos_id)
    n = len(ids) // seq
    if n == 0:
        raise RunError(f"treadle.run: the data {paths} has {len(ids)} tokens, fewer than one sample of "
                       f"seq={seq}; give more text or a smaller --seq")
    t = torch.tensor(ids[: n * seq], dtype=torch.int64).view(n, seq)
    if vocab_size is not None and int(t.max()) >= vocab_size:
        raise RunError(f"treadle.run: token id {int(t.max())} does not fit the model's vocabulary of {vocab_size}; "
                       f"use a tokenizer with at most {vocab_size} ids (the byte tokenizer needs >= 256)")
    logger.info("data: %d tokens from %d files -> %d samples of %d", len(ids), len(list_files(paths)), n, seq)
    return t


# ------------------------------------------------------------------------------------------- sampling
def split_batch(batch: int, dp_size: int, *, micro_batch: int | None, grad_accum: int | None) -> tuple[int, int]:
    """(micro batch, accumulation steps) for `batch` samples per step over `dp_size` data-parallel ranks: each
    rank takes batch / dp_size samples in `grad_accum` passes of `micro_batch` (give either, or neither: one
    pass). Raises RunError when the sizes do not divide."""
    if batch % dp_size:
        raise RunError(f"treadle.run: global batch {batch} does not divide over {dp_size} data-parallel ranks; "
                       f"use a multiple of {dp_size}")
    per_rank = batch // dp_size
    micro = micro_batch or (per_rank // grad_accum if grad_accum else per_rank)
    if micro < 1 or per_rank % micro or (grad_accum and per_rank != micro * grad_accum):
        raise RunError(f"treadle.run: batch {batch} over {dp_size} data-parallel ranks is {per_rank} per rank, "
                       f"which micro_batch={micro_batch} x grad_accum={grad_accum} does not split; "
                       f"give a micro batch that divides {per_rank}")
    return micro, per_rank // micro


@functools.lru_cache(maxsize=4)  # a pure function of its arguments: the cache cannot change a result
def _epoch_order(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_samples, generator=g)


@dataclass(frozen=True)
class Sampler:
    """Which samples each data-parallel rank reads at each optimizer step (a pure function of the step).

    `batch` samples per step in all; `dp_size` ranks take `batch // dp_size` each; `n_samples` in the data.
    Raises RunError when the batch does not divide over the data-parallel ranks."""

    n_samples: int
    batch: int
    dp_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.batch % self.dp_size:
            raise RunError(f"treadle.run: global batch {self.batch} does not divide over {self.dp_size} "
                           f"data-parallel ranks; use a multiple of {self.dp_size}")

    def _order(self, epoch: int) -> torch.Tensor:
        return _epoch_order(self.n_samples, self.seed, epoch)

    def indices(self, step: int, dp_rank: int) -> list[int]:
        """Sample indices of rank `dp_rank` at optimizer step `step` (0-based)."""
        per = self.batch // self.dp_size
        start = step * self.batch + dp_rank * per
        out = []
        for pos in range(start, start + per):
            epoch, i = divmod(pos, self.n_samples)
            out.append(int(self._order(epoch)[i]))
        return out

    def epoch(self, step: int) -> float:
        return step * self.batch / self.n_samples
