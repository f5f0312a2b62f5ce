"""Run the engines' own DFlash layer-attention code on our exports' configs, on CPU.

SGLang's `models/dflash.py` imports its CUDA kernels, so the module cannot be imported here; its
wheel (`pip download --no-deps`) is opened instead and the functions that decide a draft layer's
attention are executed as they are written: `_get_dflash_layer_attention_params` (0.5.14 on) and
`_get_dflash_attention_type` (0.5.18 on) of `models/dflash.py`, with the helpers of
`speculative/dflash_utils.py` they call and the `AttentionType` enum of `layers/radix_attention.py`.
Releases without that function (0.5.11-0.5.13) build `RadixAttention` in `DFlashAttention.__init__`
with a fixed `attn_type` and no window: read from the call itself.

vLLM imports on CPU: `vllm_layer_attention` runs `_resolve_layer_attention` of
`vllm/model_executor/models/qwen3_dflash.py` in the engine's venv.
"""
from __future__ import annotations

import ast
import json
import subprocess
import zipfile
from pathlib import Path
from typing import Optional

SGLANG_FILES = ("sglang/srt/models/dflash.py", "sglang/srt/speculative/dflash_utils.py",
                "sglang/srt/layers/radix_attention.py")


def download_sglang(version: str, cache: Path) -> Optional[Path]:
    """The three SGLang sources of `version`, extracted from its wheel (kept in `cache`); None if unreachable."""
    import sys

    target = cache / f"sglang-{version}"
    if all((target / name).is_file() for name in SGLANG_FILES):
        return target
    wheels = cache / "wheels"
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={version}",
                           "-d", str(wheels)], capture_output=True, text=True, timeout=900)
    found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if done.returncode != 0 or not found:
        return None
    with zipfile.ZipFile(found[0]) as wheel:
        for name in SGLANG_FILES:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(wheel.read(name))
    return target


def _top_level(tree: ast.Module) -> dict[str, ast.stmt]:
    return {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def _closure(names: list[str], definitions: dict[str, ast.stmt]) -> list[ast.stmt]:
    """The definitions of `names` and of every top-level name they use, in source order."""
    wanted, queue = set(), list(names)
    while queue:
        name = queue.pop()
        if name in wanted or name not in definitions:
            continue
        wanted.add(name)
        queue += [node.id for node in ast.walk(definitions[name]) if isinstance(node, ast.Name)]
    return [node for name, node in definitions.items() if name in wanted]


def sglang_attention(root: Path, config: object, num_layers: int) -> list[tuple[int, str]]:
    """(window_left, attention type name) SGLang's own code gives each draft layer of `config`."""
    model = ast.parse((root / SGLANG_FILES[0]).read_text(encoding="utf-8"))
    definitions = _top_level(model)
    if "_get_dflash_layer_attention_params" not in definitions:
        return [(-1, _fixed_attention_type(definitions["DFlashAttention"]))] * num_layers
    utils = _top_level(ast.parse((root / SGLANG_FILES[1]).read_text(encoding="utf-8")))
    radix = _top_level(ast.parse((root / SGLANG_FILES[2]).read_text(encoding="utf-8")))
    namespace: dict[str, object] = {}
    exec("from enum import Enum\nfrom typing import *\n", namespace)   # noqa: S102 (their names, our process)
    body = [radix["AttentionType"], *_closure(["get_dflash_layer_types", "get_dflash_attention_sliding_window_size"], utils),
            *_closure(["_get_dflash_layer_attention_params"], definitions)]
    exec(compile(ast.Module(body=body, type_ignores=[]), str(root / SGLANG_FILES[0]), "exec"), namespace)  # noqa: S102
    params = namespace["_get_dflash_layer_attention_params"]
    return [(window, kind.name) for window, kind in (params(config, i) for i in range(num_layers))]  # type: ignore[operator]


def _fixed_attention_type(attention_class: ast.stmt) -> str:
    """0.5.11-0.5.13: the `attn_type=AttentionType.X` of the RadixAttention call; no window keyword."""
    calls = [node for node in ast.walk(attention_class) if isinstance(node, ast.Call)
             and getattr(node.func, "id", "") == "RadixAttention"]
    assert len(calls) == 1, "one RadixAttention per DFlashAttention"
    keywords = {keyword.arg: keyword.value for keyword in calls[0].keywords}
    assert "sliding_window_size" not in keywords, "this release passes a window: read it as 0.5.14's"
    value = keywords["attn_type"]
    assert isinstance(value, ast.Attribute)
    return value.attr


VLLM_PROBE = """
import json, sys, types
from transformers import AutoConfig
import vllm.model_executor.models.qwen3_dflash as dflash
results = {}
for directory in sys.argv[1:]:
    config = AutoConfig.from_pretrained(directory)
    rows = {}
    for runner in ("v1", "v2"):
        dflash.get_current_vllm_config = lambda: types.SimpleNamespace(use_v2_model_runner=runner == "v2")
        try:
            rows[runner] = [list(dflash._resolve_layer_attention(config, i)) for i in range(config.num_hidden_layers)]
        except NotImplementedError as error:
            rows[runner] = str(error)
    results[directory] = rows
print("RESULT " + json.dumps(results))
"""


def vllm_layer_attention(python: Path, directories: list[Path]) -> dict[str, dict[str, object]]:
    """Per drafter directory, per model runner (v1, v2): vLLM's [sliding_window, causal] per layer, or its
    refusal message. `get_current_vllm_config` is replaced by one naming the runner (building a VllmConfig
    would need the V2 runner's Triton, which vLLM's CPU build lacks)."""
    done = subprocess.run([str(python), "-c", VLLM_PROBE, *map(str, directories)], capture_output=True, text=True,
                          timeout=900, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    results: dict[str, dict[str, object]] = json.loads(line[len("RESULT "):])
    return results


NGRAM_PROBE = """
import json, os, types
import numpy as np
import numba
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
os.cpu_count = lambda: 64                  # the proposer's thread cap on a 64-core node
spec = types.SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=3)
config = types.SimpleNamespace(speculative_config=spec, model_config=types.SimpleNamespace(max_model_len=64),
                               scheduler_config=types.SimpleNamespace(max_num_seqs=4),
                               parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
proposer = NgramProposer(config)           # its constructor compiles and runs the numba kernel once
context = [5, 6, 7, 8, 9, 5, 6]            # ends with 5 6: the lookup proposes what followed 5 6 before
tokens = np.zeros((4, 64), dtype=np.int32)
tokens[0, :len(context)] = context
drafts = proposer.propose(3, [[6], [], [], []], np.array([len(context), 0, 0, 0], dtype=np.int32), tokens)
print("RESULT " + json.dumps({"cap": proposer.num_numba_thread_available, "pool": numba.config.NUMBA_NUM_THREADS,
                              "drafts": drafts}))
"""


def vllm_ngram_threads(python: Path, env: dict[str, str]) -> dict[str, object]:
    """vLLM's n-gram proposer (prompt lookup) built in the engine venv under `env`: its numba thread cap
    on a 64-core node, numba's pool size and its drafts for a repetitive context."""
    done = subprocess.run([str(python), "-c", NGRAM_PROBE], capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", **env})
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, object] = json.loads(line[len("RESULT "):])
    return result
