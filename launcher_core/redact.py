"""Secrets never leave the process: redaction of secret-looking values before anything is
printed or written, and the environment variables that change GPU behaviour.

The one helper for every place that prints or writes an endpoint, an argv or a message:

* `redact_url`: a URL's user info (`user:password@`) and the values of secret query keys
  (`api_key`, `token`, `key`, `access_token`, `secret`, `password`, `sig`, ...: `is_secret_key`),
  in its query string or its fragment (`#access_token=...`);
* `redact_argv`: every element's URLs, the value of a secret-looking flag (`--api-key X`,
  `--token=X`) and of a `NAME=VALUE` with a secret-looking NAME;
* `redact_text` (and `redact_value`, `redact_document` built on it): the URLs and secret flags
  inside free text, and the values of the secret-looking environment variables wherever they
  were copied.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

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
    """The value, or REDACTED when the name looks secret; known secret values, URL credentials and
    secret flags are masked inside it (`redact_text`)."""
    if is_secret_name(name):
        return REDACTED
    return redact_text(value, secrets)


# A query key or flag name that holds a secret: the whole name, or its last part after - _ or .
# (`api_key`, `hf_token`, `--openai-api-key`), not `max_tokens` or `monkey`.
SECRET_KEY = re.compile(r"(?:^|[-_.])(?:api[-_]?key|apikey|key|token|access[-_]?token|refresh[-_]?token|secret|"
                        r"client[-_]?secret|password|passwd|pwd|credentials?|auth|authorization|sig|signature)$",
                        re.IGNORECASE)
URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>`]+")
USER_INFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)([^/?#@\s]*)@")
QUERY_PAIR = re.compile(r"([?&;#])([^=&;#\s]+)=([^&;#\s]*)")
FLAG_VALUE = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*)(=|\s+)(?!-)(\S+)")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.+)$", re.DOTALL)


def is_secret_key(name: str) -> bool:
    """Whether a URL query key or a command-line flag name (dashes stripped) names a secret."""
    return bool(SECRET_KEY.search(name.lstrip("-")))


def redact_url(url: str) -> str:
    """The URL with its user info and the values of its secret query (and fragment) keys masked."""
    masked = USER_INFO.sub(lambda m: f"{m.group(1)}{REDACTED}@" if m.group(2) else m.group(0), url)
    return QUERY_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}={REDACTED}" if is_secret_key(m.group(2)) and m.group(3)
                          else m.group(0), masked)       # an empty value holds no secret (nor a masked one's '<')


def _redact_url_in_text(found: str) -> str:
    """A URL found in prose: trailing punctuation (`).,;]`) is the sentence's, not the URL's."""
    url = found.rstrip(").,;]")
    return redact_url(url) + found[len(url):]


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    """Free text with every URL's credentials, every secret flag's value and the given secret
    values (e.g. `secret_values(os.environ)`) masked."""
    for secret in secrets or []:
        if len(secret) >= 4 and secret in text:
            text = text.replace(secret, REDACTED)
    text = URL.sub(lambda m: _redact_url_in_text(m.group(0)), text)
    return FLAG_VALUE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}" if is_secret_key(m.group(1))
                          else m.group(0), text)


def redact_argv(argv: Sequence[str], secrets: list[str] | None = None) -> list[str]:
    """A copy of `argv` safe to print or store: the value after (or in) a secret-looking flag, the
    value of a secret-looking `NAME=VALUE`, and every URL's credentials masked."""
    shown: list[str] = []
    for index, arg in enumerate(argv):
        previous = argv[index - 1] if index else ""
        assignment = ASSIGNMENT.match(arg)
        if previous.startswith("-") and "=" not in previous and is_secret_key(previous) and not arg.startswith("-"):
            shown.append(REDACTED)
        elif arg.startswith("-") and "=" in arg and is_secret_key(arg.split("=", 1)[0]):
            shown.append(f"{arg.split('=', 1)[0]}={REDACTED}")
        elif assignment and (is_secret_name(assignment.group(1)) or is_secret_key(assignment.group(1))):
            shown.append(f"{assignment.group(1)}={REDACTED}")
        else:
            shown.append(redact_text(arg, secrets))
    return shown


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


def mask_secrets(text: str) -> str:
    """`redact_text` with the values of this process's secret-looking environment variables: what
    every message, log line and report goes through before it is printed or written."""
    import os

    return redact_text(text, secret_values(os.environ))
