"""Tokenize a large corpus with datatrove (Hugging Face's pipeline library), locally or on Slurm,
into files this trainer reads in place (data/formats/datatrove.py): ``data.path=OUT``.

  python scripts/prepare_datatrove.py --input corpus/ --tokenizer /models/llama3/tokenizer.json --out /data/dt \
      --tasks 8 --workers 4                                    # this machine, 4 processes
  python scripts/prepare_datatrove.py --input /fsx/fineweb/data --format parquet \
      --tokenizer /models/llama3/tokenizer.json --out /fsx/tokens/fineweb --logs /fsx/logs/fineweb \
      --executor slurm --tasks 2000 --workers 500 --partition cpu --time 04:00:00     # a Slurm array

The pipeline is datatrove's own: a reader (JsonlReader: .jsonl, .jsonl.gz, .jsonl.zst; ParquetReader)
and DocumentTokenizer, which writes OUT/<task:05d>_unshuffled.ds (+ .index, + .metadata when the task
is complete). Task ``k`` reads the input files ``k, k + tasks, ...`` in sorted order. Documents keep
their order inside a task (shuffle_documents=False: the trainer shuffles windows itself,
docs/data.md). Each document is tokenized as scripts/prepare_data.py ``--tokenizer hf:FILE`` does it:
the tokenizer.json's own post-processor first (Llama 3's puts BOS in front), then the end-of-document
token this project's FileTokenizer uses (tokenizer_config.json's eos_token, else the known ones), so
the ids are the same. (datatrove's DocumentTokenizer alone replaces the post-processor with one that
only appends EOS, which drops the BOS.) datatrove records finished tasks under ``--logs``: a relaunch
with the same arguments runs only the unfinished ones. Train with ``data.tokenizer=hf:FILE``.

``--tokenizer byte`` tokenizes with the byte tokenizer: its tokenizer.json twin (data/tokenizer.py
byte_tokenizer_json, the byte tokenizer's ids for every string) is written to OUT/tokenizer.json for the
tasks to read; train with ``data.tokenizer=byte``.

Documents without text are dropped, as scripts/prepare_data.py drops them (data/prep/sources.py has_text:
datatrove's readers skip a document whose text is empty or null, the same test); whitespace-only ones are
kept by both, so the two give the same documents and ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_pipeline(input_dir: str, tokenizer: str, out: str, fmt: str = "jsonl", text_column: str = "text",
                   glob: str | None = None) -> list:
    from datatrove.pipeline.readers import JsonlReader, ParquetReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    from data.tokenizer import FileTokenizer

    eos = FileTokenizer.from_file(tokenizer).eos_text  # the EOS prepare_data.py appends with hf:FILE
    reader = {"jsonl": JsonlReader, "parquet": ParquetReader}[fmt]
    step = DocumentTokenizer(output_folder=out, tokenizer_name_or_path=str(tokenizer), eos_token=eos,
                             shuffle_documents=False)
    step.post_processor = own_then_eos(tokenizer, eos)  # used by datatrove instead of its EOS-only one
    return [reader(input_dir, text_key=text_column, glob_pattern=glob), step]


def own_then_eos(tokenizer: str, eos: str):
    """The post-processor that gives prepare_data.py's ids: the tokenizer's own (BOS, if it adds one),
    then ``eos`` appended. tokenizers applies only the first template of a Sequence of them, so the
    EOS goes into the tokenizer's own template (Llama 3's: ``<|begin_of_text|> $A``), or a template of
    its own when there is none."""
    from tokenizers import Tokenizer

    loaded = Tokenizer.from_file(str(tokenizer))
    spec, eos_id = json.loads(loaded.to_str()), loaded.token_to_id(eos)
    own = spec.get("post_processor")
    steps = [] if own is None else own["processors"] if own["type"] == "Sequence" else [own]
    kinds = sorted({p["type"] for p in steps} - {"ByteLevel", "TemplateProcessing"})
    if kinds or sum(p["type"] == "TemplateProcessing" for p in steps) > 1:
        raise ValueError(f"{tokenizer}: its post-processor ({', '.join(p['type'] for p in steps)}) is not one this "
                         "script extends with EOS (ByteLevel and one TemplateProcessing); use scripts/prepare_data.py")
    template = next((p for p in steps if p["type"] == "TemplateProcessing"), None)
    if template is None:
        template = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {}}
        steps.append(template)
    template["single"].append({"SpecialToken": {"id": "<EOS>", "type_id": 0}})
    template["special_tokens"]["<EOS>"] = {"id": "<EOS>", "ids": [eos_id], "tokens": [eos]}
    spec["post_processor"] = steps[0] if len(steps) == 1 else {"type": "Sequence", "processors": steps}
    return Tokenizer.from_str(json.dumps(spec)).post_processor


def write_byte_tokenizer(out: Path) -> Path:
    """The byte tokenizer's tokenizer.json twin at OUT/tokenizer.json (the same bytes on every launch)."""
    from data.tokenizer import TOKENIZER_JSON, byte_tokenizer_json

    out.mkdir(parents=True, exist_ok=True)
    path, tmp = out / TOKENIZER_JSON, out / f".{TOKENIZER_JSON}.tmp"
    byte_tokenizer_json().save(str(tmp))
    tmp.replace(path)
    return path


def make_executor(pipeline: list, args):
    if args.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        return LocalPipelineExecutor(pipeline, tasks=args.tasks, workers=args.workers, logging_dir=args.logs)
    from datatrove.executor import SlurmPipelineExecutor

    return SlurmPipelineExecutor(pipeline, tasks=args.tasks, workers=args.workers, logging_dir=args.logs,
                                 partition=args.partition, time=args.time, cpus_per_task=args.cpus_per_task,
                                 job_name="tokenize")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="folder of input files (local, or any fsspec URL)")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--glob", default=None, help="which files of --input, e.g. '*.jsonl.zst'")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--tokenizer", help="a local tokenizer.json (train with data.tokenizer=hf:FILE), or byte "
                        "(train with data.tokenizer=byte)")
    parser.add_argument("--out", help="output folder: train with data.path=OUT")
    parser.add_argument("--logs", default=None,
                        help="datatrove's logs and completion markers (default OUT-logs beside OUT)")
    parser.add_argument("--executor", choices=("local", "slurm"), default="local")
    parser.add_argument("--tasks", type=int, default=1, help="tasks: output files (one per task)")
    parser.add_argument("--workers", type=int, default=-1, help="tasks running at once (-1: all)")
    parser.add_argument("--partition", default=None, help="slurm partition")
    parser.add_argument("--time", default="04:00:00", help="slurm time limit per task")
    parser.add_argument("--cpus-per-task", type=int, default=1)
    args = parser.parse_args(argv)
    missing = [f"--{k}" for k in ("input", "tokenizer", "out") if not getattr(args, k)]
    if missing:
        print(f"error: {', '.join(missing)} required (see --help)", file=sys.stderr)
        return 2
    if args.tokenizer == "byte":
        args.tokenizer = str(write_byte_tokenizer(Path(args.out)))
    if not Path(args.tokenizer).is_file():
        print(f"error: --tokenizer {args.tokenizer}: no such file (a local tokenizer.json, or byte)", file=sys.stderr)
        return 2
    if args.executor == "slurm" and not args.partition:
        print("error: --executor slurm needs --partition", file=sys.stderr)
        return 2
    args.logs = args.logs or str(Path(args.out).parent / f"{Path(args.out).name}-logs")
    make_executor(build_pipeline(args.input, args.tokenizer, args.out, args.format, args.text_column, args.glob),
                  args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
