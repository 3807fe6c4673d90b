"""Shared test code, imported as ``support`` (pytest puts tests/ on sys.path: pyproject's
``pythonpath``): ``support.launch`` starts train.py, torchrun and the worker programs in
tests/support/workers/; ``support.config`` composes the trainer's config in this process;
``support.data`` builds data pipelines; ``support.resume`` runs and compares
kill-and-resume training runs; ``support.s3`` holds the S3 tests' server, state and kill points."""
