"""One boto3 S3 client per process, and the store's errors as the OSErrors the durable tier handles.

boto3 because it is the reference SDK: synchronous (the saver and loader already run their I/O
on threads, and botocore releases the GIL while it waits on the network), thread-safe clients,
and every call this tier needs (conditional PUT with ``If-None-Match``, multipart uploads,
ranged GETs, listing uploads left open).

Where the store is: ``checkpoint.s3.endpoint_url`` / ``region`` / ``addressing_style`` in the config
(``configure``), else boto3's own settings: ``AWS_ENDPOINT_URL_S3`` (or ``AWS_ENDPOINT_URL``) and
``AWS_REGION``. ``configure`` puts the config's values in this process's environment
(``LLM_S3_ENDPOINT_URL``, ``LLM_S3_REGION``, ``LLM_S3_ADDRESSING_STYLE``), so DCP's writer processes
(``async_process``, started by spawn: they inherit the environment, not this module's state) use the
same store. Credentials stay boto3's: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, or a profile.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Callable, List, Optional, TypeVar

T = TypeVar("T")

ADDRESSING_STYLES = ("auto", "path", "virtual")  # botocore's s3.addressing_style
# The config's settings as environment variables (set by ``configure``; they win over boto3's own)
ENDPOINT_VAR, REGION_VAR, ADDRESSING_VAR = "LLM_S3_ENDPOINT_URL", "LLM_S3_REGION", "LLM_S3_ADDRESSING_STYLE"

_lock = threading.Lock()
_client = None
_client_key: Optional[tuple] = None

# S3 error codes -> errno: a missing object is FileNotFoundError, a refused conditional write
# FileExistsError, a refusal of access PermissionError; the rest is the storage failing (EIO)
_CODES = {
    "NoSuchKey": errno.ENOENT, "404": errno.ENOENT, "NotFound": errno.ENOENT, "NoSuchBucket": errno.ENOENT,
    "NoSuchUpload": errno.ENOENT,
    "PreconditionFailed": errno.EEXIST, "412": errno.EEXIST, "ConditionalRequestConflict": errno.EEXIST,
    "AccessDenied": errno.EACCES, "403": errno.EACCES, "InvalidAccessKeyId": errno.EACCES,
    "SignatureDoesNotMatch": errno.EACCES, "QuotaExceeded": errno.EDQUOT,
}


def setting_problems(endpoint_url: Optional[str], region: Optional[str], addressing_style: str) -> List[str]:
    """What is wrong with checkpoint.s3's values (torch-free; trainer/checks.py asks)."""
    out = []
    if endpoint_url and not str(endpoint_url).startswith(("http://", "https://")):
        out.append(f"checkpoint.s3.endpoint_url={endpoint_url!r}: give the store's URL with its scheme, e.g. "
                   "http://minio.internal:9000 or https://s3.us-east-1.amazonaws.com (null: boto3's own settings)")
    if region is not None and not str(region).strip():
        out.append("checkpoint.s3.region='': give a region name (us-east-1) or null")
    if addressing_style not in ADDRESSING_STYLES:
        out.append(f"checkpoint.s3.addressing_style={addressing_style!r}: choose one of {list(ADDRESSING_STYLES)} "
                   "(path: http://host/bucket/key, which most S3-compatible stores want)")
    return out


def configure(endpoint_url: Optional[str] = None, region: Optional[str] = None,
              addressing_style: str = "auto") -> None:
    """Use these settings for every S3 call of this process and of the processes it starts (see the
    module docstring); None leaves boto3's own (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``) in charge."""
    for var, value in ((ENDPOINT_VAR, endpoint_url), (REGION_VAR, region),
                       (ADDRESSING_VAR, None if addressing_style == "auto" else addressing_style)):
        if value:
            os.environ[var] = str(value)
        else:
            os.environ.pop(var, None)


def configure_from(cfg) -> None:
    """``configure`` with a run's ``checkpoint.s3`` section (a config without one changes nothing)."""
    s3 = getattr(getattr(cfg, "checkpoint", None), "s3", None)
    if s3 is not None:
        configure(s3.endpoint_url, s3.region, s3.addressing_style)


def client():
    """This process's client, made again after a fork (a client must not cross one) or when the
    endpoint or credentials in the environment changed."""
    global _client, _client_key
    key = (os.getpid(), *(os.environ.get(k) for k in (ENDPOINT_VAR, REGION_VAR, ADDRESSING_VAR, "AWS_ENDPOINT_URL_S3",
                                                        "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_PROFILE",
                                                        "AWS_REGION", "AWS_DEFAULT_REGION")))
    with _lock:
        if _client is None or _client_key != key:
            import boto3
            from botocore.config import Config

            config = Config(retries={"max_attempts": int(os.environ.get("LLM_S3_MAX_ATTEMPTS", "5")),
                                     "mode": "standard"},
                            connect_timeout=float(os.environ.get("LLM_S3_CONNECT_TIMEOUT_S", "10")),
                            read_timeout=float(os.environ.get("LLM_S3_READ_TIMEOUT_S", "60")),
                            max_pool_connections=32,
                            s3={"addressing_style": os.environ.get(ADDRESSING_VAR, "auto")})
            where = {k: v for k, v in (("endpoint_url", os.environ.get(ENDPOINT_VAR)),
                                       ("region_name", os.environ.get(REGION_VAR))) if v}
            _client, _client_key = boto3.session.Session().client("s3", config=config, **where), key
        return _client


def as_oserror(exc: BaseException, what: str) -> OSError:
    """The OSError the durable tier understands for a botocore failure of ``what`` (an s3:// URL)."""
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        number = _CODES.get(code, _CODES.get(status, errno.EIO))
        cls = {errno.ENOENT: FileNotFoundError, errno.EEXIST: FileExistsError,
               errno.EACCES: PermissionError}.get(number, OSError)
        return cls(number, f"S3 {code or status}: {err.get('Message', exc)}", what)
    return OSError(errno.EIO, f"S3 endpoint unreachable or failing ({type(exc).__name__}: {exc})", what)


def call(what: str, fn: Callable[..., T], **kwargs) -> T:
    """``fn(**kwargs)`` (a client method), its botocore failures raised as OSErrors naming ``what``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(**kwargs)
    except (ClientError, BotoCoreError) as exc:
        raise as_oserror(exc, what) from exc
