"""Offline preparation: text in, token files out (scripts/prepare_data.py). A training run never
imports this package: data.prepare_if_missing runs the script in a process of its own.

  sources.py     documents: the built-in corpora, .txt, .jsonl(.gz, .zst), .parquet, folders of them
  split.py       which documents are held out for validation (a hash of their text)
  bpe.py         the tokenizer to encode with; a BPE trained on the corpus
  writer.py      the prepared dataset's writer, and the single-process preparation
  shards.py      the preparation in N processes into a folder of shards, resumable
"""
