"""Fixtures of the generation tests; the helpers live in gen_helpers (a unique module name, so
test files can import them whichever folders one pytest run collects)."""
from gen_helpers import fault_proxy_factory, served_tiny_model  # noqa: F401  (fixtures)
