"""Secrets never leave the process: redaction of secret-looking values before anything is
printed or written, and the environment variables that change GPU behaviour."""
from __future__ import annotations

import re
from typing import Any, Mapping

REDACTED = "<redacted>"
# TOKEN but not TOKENIZERS_PARALLELISM and the like: tokenizer settings are not secrets.
SECRET_NAME = re.compile(r"TOKEN(?!IZ)|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
GPU_VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "CUDA_HOME",
    "CUDA_PATH", "TRITON_PTXAS_PATH", "FLASHINFER_CUDA_ARCH_LIST", "FLASHINFER_WORKSPACE_BASE",
    "LD_LIBRARY_PATH",
)
GPU_PREFIXES = ("NCCL_", "TORCH_NCCL_")


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with the values of secret-looking names replaced by REDACTED."""
    return {name: REDACTED if is_secret_name(name) else value for name, value in env.items()}


def redact_value(name: str, value: str, secrets: list[str] | None = None) -> str:
    """The value, or REDACTED when the name looks secret; known secret values are masked inside it."""
    if is_secret_name(name):
        return REDACTED
    for secret in secrets or []:
        if len(secret) >= 4 and secret in value:
            value = value.replace(secret, REDACTED)
    return value


def secret_values(environ: Mapping[str, str]) -> list[str]:
    """The values of secret-looking variables (to mask wherever they were copied)."""
    return [value for name, value in environ.items() if is_secret_name(name) and value]


def gpu_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that change GPU behaviour, secret-looking values redacted."""
    secrets = secret_values(environ)
    chosen = {name: value for name, value in environ.items()
              if name in GPU_VARIABLES or name.startswith(GPU_PREFIXES)}
    return {name: redact_value(name, chosen[name], secrets) for name in sorted(chosen)}


def redact_document(document: Any, secrets: list[str]) -> Any:
    """Mask known secret values anywhere in JSON-like data (a last line of defence)."""
    if isinstance(document, dict):
        return {key: redact_document(value, secrets) for key, value in document.items()}
    if isinstance(document, list):
        return [redact_document(value, secrets) for value in document]
    if isinstance(document, str):
        return redact_value("", document, secrets)
    return document
