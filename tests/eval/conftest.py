"""Fixtures of the eval tests; the helpers live in eval_helpers and engine_vllm_common (unique module names)."""
from engine_vllm_common import answers, demo_drafter, engine_profile, sliding_drafter  # noqa: F401  (fixtures)
from eval_helpers import single_torch_thread, tiny_qwen3_model, twin_model  # noqa: F401  (fixtures)
