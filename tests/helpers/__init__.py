"""Shared test code, imported as ``helpers`` (pytest puts tests/ on sys.path: pyproject's
``pythonpath``): ``helpers.launch`` starts train.py, torchrun and the worker programs in
tests/workers/; ``helpers.config`` composes the trainer's config in this process;
``helpers.data`` builds data pipelines; ``helpers.resume`` runs and compares
kill-and-resume training runs; ``helpers.s3`` holds the S3 tests' server, state and kill points."""
