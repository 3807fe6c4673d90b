"""The byte tokenizer's tokenizer.json twin (data/tokenizer.py byte_tokenizer_json: what an export of a byte model
ships and what datatrove tokenizes byte data with) is the byte tokenizer: the same ids for every string, the
literal ``<|endoftext|>`` inside a document included (its 13 bytes, never the EOS id), and the same text back
from every id sequence. A property test over seeded random text; the preparation through the twin (``hf:FILE``)
writes the byte tokenizer's tokens."""

from __future__ import annotations

import json
import random

import numpy as np

from data.formats.native import TokenFile
from data.prep.writer import prepare_token_file
from data.tokenizer import EOS_TEXT, ByteTokenizer, FileTokenizer, byte_tokenizer_json
from support.text import random_text


def test_the_issues_example():
    text = "x <|endoftext|> y"
    assert ByteTokenizer().encode(text) == list(text.encode()) == byte_tokenizer_json().encode(text).ids
    assert byte_tokenizer_json().token_to_id(EOS_TEXT) == ByteTokenizer.eos_id  # how an appender finds EOS


def test_the_twin_encodes_every_string_as_the_byte_tokenizer_does():
    ours, twin, rng = ByteTokenizer(), byte_tokenizer_json(), random.Random(36)
    texts = [random_text(rng) for _ in range(3000)]
    assert sum(EOS_TEXT in t for t in texts) > 200  # the literal is well represented (265 of them)
    for text, encoding in zip(texts, twin.encode_batch(texts)):
        assert encoding.ids == ours.encode(text), text


def test_the_twin_decodes_every_id_sequence_as_the_byte_tokenizer_does():
    """Any ids, valid UTF-8 or not, EOS anywhere: the same text (EOS decodes to nothing; a broken byte
    sequence to U+FFFD alike)."""
    ours, twin, rng = ByteTokenizer(), byte_tokenizer_json(), random.Random(7)
    for _ in range(3000):
        ids = [rng.choice([rng.randint(0, 256), rng.randint(0x80, 0xFF), 256]) for _ in range(rng.randint(0, 24))]
        assert twin.decode(ids) == ours.decode(ids), ids
    for text in (random_text(rng) for _ in range(500)):
        ids = ours.encode(text) + [ByteTokenizer.eos_id]
        assert twin.decode(ids) == ours.decode(ids) == text


def test_preparing_through_the_twin_writes_the_byte_tokenizers_tokens(tmp_path):
    """What datatrove and any other tool that reads a tokenizer.json get from the twin: prepare_data.py with
    ``--tokenizer hf:TWIN`` (the twin's ids, its EOS found by name) equals ``--tokenizer byte``."""
    rng = random.Random(11)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": random_text(rng) + EOS_TEXT + random_text(rng)}) + "\n"
                              for _ in range(40)))
    twin = tmp_path / "twin" / "tokenizer.json"
    twin.parent.mkdir()
    byte_tokenizer_json().save(str(twin))
    assert FileTokenizer.from_file(twin).eos_id == ByteTokenizer.eos_id
    prepare_token_file(tmp_path / "byte", [str(corpus)], "byte")
    prepare_token_file(tmp_path / "twin-data", [str(corpus)], f"hf:{twin}")
    byte, through_twin = TokenFile(tmp_path / "byte"), TokenFile(tmp_path / "twin-data")
    assert np.array_equal(byte.tokens, through_twin.tokens)
    assert byte.meta.num_documents == through_twin.meta.num_documents == 40
    assert int((np.asarray(byte.tokens) == ByteTokenizer.eos_id).sum()) == 40  # one EOS per document, none inside
