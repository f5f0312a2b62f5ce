"""Fixtures of the eval tests; the helpers live in eval_helpers (a unique module name)."""
from eval_helpers import single_torch_thread, tiny_qwen3_model, twin_model  # noqa: F401  (fixtures)
