"""The profile schema: one frozen dataclass per TOML section.

Every field has a type (checked strictly by `launcher_core.profile`) and, unless it is required, a
default. `Literal[...]` fields list their valid choices. Paths are strings, relative to the
repository root unless absolute; `{run_dir}` in a path expands to the profile's run directory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

AttentionBackend = Literal["flashinfer", "fa3", "trtllm", "triton", "torch_sdpa"]


@dataclass(frozen=True)
class MachineSection:
    """What the node is and how ranks are launched on it."""

    device: Literal["cuda", "cpu"]
    gpu_count: int = 0                       # GPUs the profile expects (0 on CPU)
    gpu_name: str = ""                       # substring of the NVML name, e.g. "RTX PRO 6000"
    gpu_memory_gib: float = 0.0              # total memory per GPU
    compute_capability: str = ""             # "12.0" for SM120
    cuda: str = ""                           # torch CUDA tag the pins use, "12.8" / "13.0"; "" on CPU
    requirements: str = "requirements-cpu.txt"
    backend: Literal["nccl", "gloo"] = "nccl"
    nproc_per_node: int = 1
    nnodes: int = 1
    rdzv_endpoint: str = ""                  # host:port of the c10d rendezvous for nnodes > 1
    bind_host: str = "127.0.0.1"             # where servers listen


@dataclass(frozen=True)
class AuditSection:
    """Thresholds of the preflight audit."""

    attention_backend: AttentionBackend = "flashinfer"
    min_free_gib_per_gpu: float = 0.0
    baseline_free_tolerance_mib: int = 128
    baseline_context_tolerance_mib: int = 64
    min_shm_gib: float = 1.0
    min_disk_gib: float = 10.0
    min_ram_gib: float = 4.0
    gib_per_nvcc_job: float = 5.0


@dataclass(frozen=True)
class ModelSection:
    """The target model. `target` is a local directory, or `builtin:smollm2-135m-instruct`."""

    target: str
    tokenizer: str = ""                      # defaults to the target's directory
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


@dataclass(frozen=True)
class PathsSection:
    run_dir: str = "runs/{profile}"
    prompts: str = "{run_dir}/prompts.jsonl"
    completions: str = "{run_dir}/completions.jsonl"
    dataset: str = "{run_dir}/dataset"
    eval_prompts: str = ""


@dataclass(frozen=True)
class DataSection:
    """Tokenization and data-quality gates."""

    max_length: int = 8192
    num_workers: int = 0                     # 0: one per core
    shard_rows: int = 20000
    min_loss_tokens: int = 16                # fewer is degenerate (the seeds' 6-token empties)
    max_degenerate_share: float = 0.05
    tool_call_repeat_limit: int = 8
    rewritten_turns: Literal["split", "context"] = "split"  # turns the template rewrites later: own sample, or context only


@dataclass(frozen=True)
class GenerateSection:
    backend: Literal["sglang", "transformers", "endpoint", "vllm"] = "sglang"
    port: int = 30000
    concurrency: int = 256
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_tokens: int = 8192
    thinking: bool = True
    request_timeout_s: float = 600.0
    retries: int = 3
    max_server_restarts: int = 3
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float = 0.85
    reasoning_parser: str = "qwen3"
    flush_every: int = 32
    tool_call_parser: str = ""               # SGLang --tool-call-parser (e.g. "qwen25"); "" leaves tool calls in content
    server_startup_timeout_s: float = 900.0  # how long a started server may take to answer /health
    max_prompts: int = 0                     # use only the first N prompts of paths.prompts (0: all)
    continuous_batching: bool = False        # transformers serve --continuous-batching (one batched forward)
    cb_num_blocks: int = 0                   # its KV cache in blocks of 256 tokens (0: sized from free memory)
    server_threads: int = 0                  # OMP_NUM_THREADS of a CPU server (0: 1, unless already set)
    context_length: int = 0                  # SGLang --context-length (prompt + completion); 0: the model's own
    vllm_cpu_kvcache_gib: int = 2            # vLLM on CPU: VLLM_CPU_KVCACHE_SPACE, GiB of RAM for its KV cache
                                             # (on CPU it takes no --gpu-memory-utilization share)
    vllm_max_model_len: int = 0              # vLLM --max-model-len (0: generate.context_length, else the model's own)
    vllm_enforce_eager: bool = False         # vLLM --enforce-eager: starts in ~30 s on CPU instead of 100-140 s of compile


@dataclass(frozen=True)
class DrafterSection:
    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = ()   # empty: spaced from layer 1 to N-3 (DESIGN.md)
    mask_token_id: Optional[int] = None      # None: the tokenizer's mask token, else an error
    norm_init: float = 1.0                   # final norm's start: its weight (random init), a factor on the target's (target init)
    init: Literal["random", "target"] = "random"  # target: layers start as the target's layers after the deepest tap
    draft_vocab_size: int = 0                # 0: the target's vocabulary; N: only the N most frequent training tokens
    # The drafter's own attention shape and RoPE (docs/train.md, "Drafter shape"); 0 derives from the
    # target: head dim min(target's, 128), the target's query/KV widths, plain RoPE at the target's theta.
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0                        # <= 128 on SM12x: flex_attention's bf16 backward runs out of shared memory above
    rope_theta: float = 0.0                  # plain RoPE base, written as top-level `rope_theta` in config.json


@dataclass(frozen=True)
class TrainSection:
    epochs: int = 6
    max_steps: int = 0                       # 0: run all epochs
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    global_batch: int = 64                   # sequences per optimizer step, across all ranks
    max_micro_batch: int = 4                 # sequences per forward on one rank, at most
    num_anchors: int = 512
    seed: int = 0
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    save_every_steps: int = 500
    log_every_steps: int = 10
    max_restarts: int = 0                    # torchrun --max-restarts
    decay_gamma: float = 0.0                 # loss decay exp(-(k-1)/gamma); 0: 7/5/4 for B = 16/10/8
    loss_chunk_rows: int = 2048              # drafter logits rows per chunk (vocab-sized rows)
    optimizer_sharding: Literal["none", "zero1"] = "zero1"  # zero1: AdamW states sharded over ranks
    autocast: Literal["auto", "bfloat16", "off"] = "auto"  # drafter forward: auto = bf16 on CUDA, fp32 on CPU
    feature_cache: bool = False              # each row's tap features extracted once, kept as files for later epochs


@dataclass(frozen=True)
class MemorySection:
    margin: float = 0.10                     # fraction of free memory held back
    overhead_mib: int = 0                    # non-torch overhead if not measured (0: from probe/baseline)


@dataclass(frozen=True)
class EvalSection:
    num_prompts: int = 32
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0                            # sampling seed (temperature > 0)
    prompt_lookup_max_ngram: int = 3         # the n-gram baseline's longest suffix match
    cpu_threads: int = 1                     # torch threads when decoding on CPU (0: torch's default);
                                             # more threads stall small batch-1 forwards on a busy CPU
    engine: Literal["transformers", "sglang", "vllm"] = "transformers"  # who decodes: in-process, or the serving engine
    engine_python: str = ""                  # python of the environment with the engine ("": this one)
    engine_port: int = 30100                 # where the engine eval's servers listen (127.0.0.1)
    also_prompts: tuple[str, ...] = ()       # more prompt sets measured beside the default one (not with --prompts),
                                             # each reported apart and labelled (eval/<file stem>/)
    serve_engine: Literal["", "sglang", "vllm"] = ""  # the engine that will serve the drafter: the pipeline runs
                                             # `eval --engine` with it after the in-process eval (served vs in-process tau)


@dataclass(frozen=True)
class Profile:
    name: str
    machine: MachineSection
    model: ModelSection
    description: str = ""
    audit: AuditSection = field(default_factory=AuditSection)
    paths: PathsSection = field(default_factory=PathsSection)
    data: DataSection = field(default_factory=DataSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    train: TrainSection = field(default_factory=TrainSection)
    memory: MemorySection = field(default_factory=MemorySection)
    eval: EvalSection = field(default_factory=EvalSection)
