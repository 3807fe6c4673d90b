"""S3 and S3-compatible object stores as a checkpoint store (a unit: delete this folder and the lines
marked ``# unit: s3`` to drop it).

  config.py   checkpoint.s3's settings (boto3-free), and ``configure``, which hands them to every S3 call
  store.py    S3Store, through boto3: imported at the first ``s3://`` URL a run names
"""
