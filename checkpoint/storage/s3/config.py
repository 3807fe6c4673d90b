"""checkpoint.s3: where an ``s3://`` checkpoint.dir or model.init_from lives (torch- and boto3-free: the
config checks read it). ``configure`` puts the values in this process's environment, so DCP's writer
processes (``async_process``, started by spawn: they inherit the environment, not module state) use the
same store."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from configs.keys import key

ADDRESSING_STYLES = ("auto", "path", "virtual")  # botocore's s3.addressing_style
ENDPOINT_VAR, REGION_VAR, ADDRESSING_VAR = "LLM_S3_ENDPOINT_URL", "LLM_S3_REGION", "LLM_S3_ADDRESSING_STYLE"


@dataclass
class S3Config:
    """checkpoint.s3: where an ``s3://`` checkpoint.dir (or model.init_from) lives. null: boto3's own settings
    (AWS_ENDPOINT_URL_S3, AWS_REGION); credentials are always boto3's."""

    endpoint_url: Optional[str] = key(None, "an S3-compatible store: http://minio.internal:9000")
    region: Optional[str] = key(None, "us-east-1")
    addressing_style: str = key("auto", "auto | path (http://host/bucket/key, which most S3-compatible stores want) "
                                "| virtual (http://bucket.host/key)", choices=ADDRESSING_STYLES)

    def check(self) -> List[str]:
        out = []
        if self.endpoint_url and not str(self.endpoint_url).startswith(("http://", "https://")):
            out.append(f"checkpoint.s3.endpoint_url={self.endpoint_url!r}: give the store's URL with its scheme, e.g. "
                       "http://minio.internal:9000 or https://s3.us-east-1.amazonaws.com (null: boto3's own settings)")
        if self.region is not None and not str(self.region).strip():
            out.append("checkpoint.s3.region='': give a region name (us-east-1) or null")
        return out


def configure(endpoint_url: Optional[str] = None, region: Optional[str] = None,
              addressing_style: str = "auto") -> None:
    """Use these settings for every S3 call of this process and of the processes it starts; None leaves
    boto3's own (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``) in charge."""
    for var, value in ((ENDPOINT_VAR, endpoint_url), (REGION_VAR, region),
                       (ADDRESSING_VAR, None if addressing_style == "auto" else addressing_style)):
        if value:
            os.environ[var] = str(value)
        else:
            os.environ.pop(var, None)
