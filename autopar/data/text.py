"""Text from local files as fixed-length token samples, tokenized by bytes (no vocabulary to download).

``ByteTokenizer``: token = byte value (0..255) of the UTF-8 text, plus ``eos`` = 256 between files, so
the vocabulary has 257 entries and decoding is exact. ``TextSamples``: the files' tokens, concatenated
in the order given, cut into ``len // (seq_len + 1)`` samples of seq_len + 1 tokens; sample i is
tokens [i·(seq_len+1), (i+1)·(seq_len+1)), so a sample id names the same tokens on every rank. A batch
of ids gives (input_ids, labels) = (sample[:, :-1], sample[:, 1:]) for a model that does not shift
its labels, or (sample[:, :-1], sample[:, :-1]) with ``shifted_labels=False`` for one that does (Hugging
Face causal LMs shift inside their loss).
"""
from __future__ import annotations

from pathlib import Path

import torch

from autopar.errors import UsageError


class ByteTokenizer:
    vocab_size = 257
    eos = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


class TextSamples:
    def __init__(self, paths, seq_len: int, tokenizer: ByteTokenizer | None = None):
        self.tokenizer = tokenizer or ByteTokenizer()
        self.seq_len = seq_len
        files = _text_files(paths)
        tokens: list[int] = []
        for path in files:
            tokens += self.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")) + [self.tokenizer.eos]
        n = len(tokens) // (seq_len + 1)
        if n == 0:
            raise UsageError(f"{len(tokens)} tokens in {[str(p) for p in files]} make no sample of {seq_len + 1} "
                             f"tokens; add text or lower seq_len")
        self.tokens = torch.tensor(tokens[:n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch(self, ids: torch.Tensor, shifted_labels: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tokens[ids]
        inputs = rows[:, :-1].contiguous()
        return inputs, (rows[:, 1:].contiguous() if shifted_labels else inputs.clone())


def _text_files(paths) -> list[Path]:
    """The files named, and the *.txt / *.md files under directories named, in sorted order."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in (".txt", ".md"))
        elif p.is_file():
            out.append(p)
        else:
            raise UsageError(f"no text file or directory at {str(p)!r}; pass files or directories of .txt/.md files")
    if not out:
        raise UsageError(f"no .txt or .md files under {[str(p) for p in paths]}")
    return out
