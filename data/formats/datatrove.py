"""datatrove's tokenised output (``DocumentTokenizer``: ``NAME.ds``, ``NAME.ds.index``,
``NAME.ds.metadata``) as a shard, read in place.

The ``.ds`` file holds every document's ids back to back (uint16, or uint32 for a vocabulary over
65,536), each ended by EOS when the step was given ``eos_token``; ``.ds.index`` holds the documents'
end offsets (uint64); ``.ds.metadata`` ("TOKENIZER|TOKEN_SIZE", the token count, a readable count)
is written when the file is closed, so it is the completion marker: a ``.ds`` without it is
unfinished and refused. When the metadata names a tokenizer file that exists here, it must be the
file ``data.tokenizer`` names (the same sha256), which otherwise describes them (data/formats/shard.py).
``data.path`` names a folder of ``.ds`` files, each a shard in name order.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import numpy as np

from data.formats.shard import MappedShard, cheap_fingerprint, untagged_meta, untagged_tokenizer
from data.prepared import DataError
from data.tokenizer import FileTokenizer, sha256_of

NAME = "datatrove"
WHAT = "a folder of datatrove's tokenised files (NAME.ds + .ds.index + .ds.metadata)"


class DatatroveShard(MappedShard):
    def __init__(self, path: str | Path, tok):
        self.path = Path(path)
        meta_path, index_path = Path(f"{path}.metadata"), Path(f"{path}.index")
        if not meta_path.is_file():
            raise DataError(f"{path} has no {meta_path.name}: datatrove writes it when the file is complete, so this "
                            "task is unfinished; run the datatrove pipeline again (it redoes unfinished tasks)")
        name_size, count = meta_path.read_text().splitlines()[:2]
        name, size = name_size.rsplit("|", 1)
        dtype = {"2": np.uint16, "4": np.uint32}.get(size)
        if dtype is None or int(count) * int(size) != self.path.stat().st_size:
            raise DataError(f"{path} is {self.path.stat().st_size} bytes, but {meta_path.name} says {count} tokens of "
                            f"{size} bytes: truncated or mixed up; tokenize it again")
        if Path(name).is_file() and isinstance(tok, FileTokenizer) and sha256_of(Path(name)) != sha256_of(tok.path):
            raise DataError(f"{path} was tokenized with {name}, not data.tokenizer's {tok.path} (another sha256); "
                            "point data.tokenizer at the file that made it")
        documents = index_path.stat().st_size // 8 if index_path.is_file() else 0
        self.meta = untagged_meta(tok, NAME, np.dtype(dtype).name, int(count), documents,
                                  cheap_fingerprint(self.path, meta_path), self.path)
        self.tokens = self._map()


def find(path: Path) -> List[Path]:
    return sorted(path.glob("*.ds")) if path.is_dir() else []


def open_shards(path: Path, found: List[Path], tokenizer: Optional[str]) -> List[DatatroveShard]:
    tok = untagged_tokenizer(tokenizer, NAME, path)
    return [DatatroveShard(p, tok) for p in found]
