"""Checkpoints on S3 and S3-compatible object stores (``checkpoint.dir=s3://bucket/prefix``).

``client.py`` the boto3 client and its errors as OSErrors; ``path.py`` ``S3Path``, the part of
pathlib the durable tier uses, over objects; ``streams.py`` a multipart upload written as a file
and ranged GETs read as one. The commit without a rename is in checkpoint/durable/commit.py: the
manifest is written last, with ``If-None-Match: *`` (docs/checkpoint-format.md).
"""
