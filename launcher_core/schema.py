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
    server_threads: int = 0                  # OMP_NUM_THREADS of a CPU server (0: transformers serve 1 unless
    #                                          already set, vLLM torch's default)
    context_length: int = 0                  # SGLang --context-length (prompt + completion); 0: the model's own
    vllm_cpu_kvcache_gib: int = 2            # vLLM on CPU: VLLM_CPU_KVCACHE_SPACE, GiB of RAM for its KV cache
                                             # (on CPU it takes no --gpu-memory-utilization share)
    vllm_max_model_len: int = 0              # vLLM --max-model-len (0: generate.context_length, else the model's own)
    vllm_enforce_eager: bool = False         # vLLM --enforce-eager: starts in ~30 s on CPU instead of 100-140 s of compile


DrafterKind = Literal["dflash", "dflash2"]
# The DFlash 2 keys (`drafter.kind = "dflash2"`) and their published values: z-lab's Qwen3.8-27B-DFlash2
# and SpecForge's configs/qwen3.6-27b-dflash2.json (kernel 2, groups of 16 channels, rank 256, top-16),
# the defaults of vLLM Speculators' `dflash2` (PR #1006); a unit multiplier and no softcap as the
# reference `DFlash2DraftModel.compute_logits` reads their absence. docs/train.md, "DFlash 2".
DFLASH2_DEFAULTS: dict[str, float] = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                                      "selector_top_k": 16, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}


@dataclass(frozen=True)
class DrafterSection:
    kind: DrafterKind = "dflash"             # dflash2: the causal convolutions and the candidate selector (DFlash2DraftModel)
    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = ()   # empty: spaced from layer 1 to N-3 (DESIGN.md)
    mask_token_id: Optional[int] = None      # None: the tokenizer's mask token, else an error
    norm_init: float = 1.0                   # final norm's start: its weight (random init), a factor on the target's (target init)
    init: Literal["random", "target", "drafter"] = "random"  # target: layers start as the target's layers after the deepest tap; drafter: from init_from
    draft_vocab_size: int = 0                # 0: the target's vocabulary; N: only the N most frequent training tokens
    # The drafter's own attention shape and RoPE (docs/train.md, "Drafter shape"); 0 derives from the
    # target: head dim min(target's, 128), the target's query/KV widths, plain RoPE at the target's theta.
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0                        # <= 128 on SM12x: flex_attention's bf16 backward runs out of shared memory above
    rope_theta: float = 0.0                  # plain RoPE base, written as top-level `rope_theta` in config.json
    # Per-layer attention and RoPE scaling (docs/train.md, "Drafter layers"): empty layer_types = every
    # layer full_attention; sliding_attention layers see `sliding_window` positions back (causal, as published).
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] = ()
    sliding_window: int = 0
    rope_scaling: Literal["none", "linear", "yarn"] = "none"
    rope_scaling_factor: float = 1.0
    rope_original_max_position_embeddings: int = 0   # yarn: the context the RoPE was made for (0: max_position_embeddings)
    init_from: str = ""                      # init = "drafter": a DFlash drafter directory (z-lab format) or our checkpoint
    # DFlash 2 only (kind = "dflash2"; published defaults, DFLASH2_DEFAULTS): a grouped dynamic causal
    # convolution of `conv_kernel_size` taps (one dynamic kernel per `conv_group_size` channels) around
    # every attention and MLP sublayer, and a candidate selector re-ranking the head's top `selector_top_k`
    # tokens per slot with rank-`selector_rank` predecessor/successor codebooks. The unary logits are
    # lm_head * output_multiplier, then tanh-softcapped at final_logit_softcapping (0: none).
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0


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
    save_every_minutes: float = 0.0          # also a checkpoint once this many minutes have passed since the last
                                             # (0: by steps only): bounds in time the work a restart loses
    async_save: bool = True                  # checkpoint shards written by a thread while the ranks train on
                                             # (DCP async_save; dflash.train.checkpointing)
    keep_checkpoints: int = 0                # the newest N checkpoints kept, with the best by held-out tau and the
                                             # latest (dflash.train.retention); 0: every checkpoint
    log_every_steps: int = 10
    max_restarts: int = 0                    # torchrun --max-restarts
    rank_start: Literal["forkserver", "command"] = "forkserver"   # forkserver: ranks forked from torchrun's forkserver,
                                             # which imports torch and the model code once; command: each rank a new
                                             # python (`-m dflash.train.worker`) that imports them itself
    decay_gamma: float = 0.0                 # loss decay exp(-(k-1)/gamma); 0: 7/5/4 for B = 16/10/8
    loss_chunk_rows: int = 2048              # drafter logits rows per chunk (vocab-sized rows)
    autocast: Literal["auto", "bfloat16", "off"] = "auto"  # drafter forward: auto = bf16 on CUDA, fp32 on CPU
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # drafter's residual stream and norms (bf16: on bf16 weight copies)
    feature_cache: bool = False              # each row's tap features extracted once, kept as files for later epochs
    # The drafter under FSDP2 (docs/memory.md, "Sharding"): parameters, gradients and AdamW states sharded over the ranks.
    reshard_after_forward: bool = True       # draft layers' gathered weights freed after forward, gathered again in backward
                                             # (False: kept from forward to backward, FSDP1's SHARD_GRAD_OP)
    gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = "every_micro_batch"   # reduce-scatter each
                                             # micro-batch's gradients (sharded accumulation), or hold unsharded ones until the last
    activation_checkpointing: Literal["none", "layers"] = "none"   # layers: each draft layer's activations recomputed in backward
    heartbeat_timeout_s: float = 120.0       # a rank whose process stops beating this long is named and the run ended
    collective_timeout_s: float = 600.0      # the process group's timeout: a collective waits this long for a rank
    stuck_after_steps: float = 5.0           # a rank that holds the others this many measured step times is named
    stuck_floor_s: float = 120.0             # ... never sooner than this (dflash.train.watchdog)
    # DFlash 2 (drafter.kind = "dflash2"): loss = DFlash loss on the unary logits + alpha x the selector's
    # K-way cross entropy (SpecForge PR #772 `dflash2_selector_loss_alpha`, vLLM Speculators PR #1006: 1.0);
    # stop_gradient: the selector term trains only the selector, not the backbone it reads (SpecForge PR #793, off).
    selector_loss_alpha: float = 1.0
    selector_stop_gradient: bool = False
    validation_share: float = 0.0            # share of the dataset's rows held out of training and measured on (0: none)
    validation_every_steps: int = 0          # held-out loss and tau every N steps and at the end (0: at every checkpoint)


@dataclass(frozen=True)
class MemorySection:
    margin: float = 0.10                     # fraction of free memory held back
    overhead_mib: int = 0                    # non-torch overhead if not measured (0: from probe/baseline)
    expandable_segments: bool = True         # CUDA ranks' caching allocator grows segments instead of fragmenting
                                             # fixed ones (envcheck.allocator: the user's own PYTORCH_ALLOC_CONF /
                                             # PYTORCH_CUDA_ALLOC_CONF is completed, an explicit setting kept)


@dataclass(frozen=True)
class EvalSection:
    num_prompts: int = 32
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0                            # sampling seed (temperature > 0)
    prompt_lookup_max_ngram: int = 3         # the n-gram baseline's longest suffix match
    draft_tokens: int = 0                    # DFlash draft tokens a step proposes, the target verifies k + 1
                                             # (in-process and served: vLLM num_speculative_tokens); 0: block_size - 1
    cpu_threads: int = 1                     # torch threads when decoding on CPU (0: torch's default);
                                             # more threads stall small batch-1 forwards on a busy CPU
    cpu_matmul: Literal["auto", "torch"] = "auto"   # float32 on CPU: auto = the faster kernel per row count for
                                             # every linear layer (dflash.eval.cpu_kernels); torch = nn.Linear as is
    engine: Literal["transformers", "sglang", "vllm"] = "transformers"  # who decodes: in-process, or the serving engine
    engine_python: str = ""                  # python of the environment with the engine ("": this one)
    engine_port: int = 30100                 # where the engine eval's servers listen (127.0.0.1)
    also_prompts: tuple[str, ...] = ()       # more prompt sets measured beside the default one (not with --prompts),
                                             # each reported apart and labelled (eval/<file stem>/)
    serve_engine: Literal["", "sglang", "vllm"] = ""  # the engine that will serve the drafter: the pipeline runs
                                             # `eval --engine` with it after the in-process eval (served vs in-process tau)
    benchmarks: tuple[str, ...] = ()         # benchmarks decoded beside the default set (BENCHMARK_NAMES; `--bench`),
                                             # one row each, eval/bench/<name>/
    bench_dir: str = ""                      # local copies of gsm8k, math500, mbpp (DIR/<name>/<split>.jsonl or a
                                             # save_to_disk folder DIR/<name>/); "": the hub or its cache


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


# Keys that profiles once had: a profile that still sets one is told what replaced it.
REMOVED_KEYS: dict[str, str] = {
    "train.optimizer_sharding": "the drafter's parameters, gradients and AdamW states are now always sharded over the "
                                "ranks by FSDP2 (fully_shard); delete the key (train.reshard_after_forward = false keeps "
                                "the gathered weights from forward to backward, as SHARD_GRAD_OP)",
    "train.grad_bucket_mib": "gradients are reduced by FSDP2's reduce-scatter, not by buckets of ours; delete the key",
}


# --- range rules: one declarative table, checked by launcher_core.profile for every source -------

@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key (each element, for a list): `low`..`high` (either end
    open with `low_open`/`high_open`), always finite; `zero` (when set) allows 0 and says what it
    means ("all epochs"), for keys whose 0 is a documented default outside the range."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    zero: str = ""

    def admits(self, value: float) -> bool:
        import math

        if not math.isfinite(value):
            return False
        if self.zero and value == 0:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a finite number"
        low = None if self.low is None else f"{'>' if self.low_open else '>='} {_number(self.low)}"
        high = None if self.high is None else f"{'<' if self.high_open else '<='} {_number(self.high)}"
        bounds = " and ".join(part for part in (low, high) if part)
        return f"{kind}{' ' + bounds if bounds else ''}" + (f" (or 0: {self.zero})" if self.zero else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


AT_LEAST_0, AT_LEAST_1, POSITIVE = Range(0), Range(1), Range(0, low_open=True)
SHARE, PORT = Range(0, 1), Range(1, 65535)

# dotted key -> Range. Every int/float key of the schema has a line here (tests/test_safety_profile.py
# holds it): a new numeric key gets its rule with one line. Sizes and counts have an upper bound
# too, far above any real run and low enough that nothing sized by them (the plan's lists and lines,
# a rank's buffers, a pool of workers) grows without limit: 2**20 sequences per optimizer step,
# 1024 ranks per node, 2**22 tokens per sequence.
RANGES: dict[str, Range] = {
    "machine.gpu_count": Range(0, 1024),
    "machine.gpu_memory_gib": Range(0, 16384),
    "machine.nproc_per_node": Range(1, 1024),
    "machine.nnodes": Range(1, 4096),
    "audit.min_free_gib_per_gpu": AT_LEAST_0,
    "audit.baseline_free_tolerance_mib": AT_LEAST_0,
    "audit.baseline_context_tolerance_mib": AT_LEAST_0,
    "audit.min_shm_gib": AT_LEAST_0,
    "audit.min_disk_gib": AT_LEAST_0,
    "audit.min_ram_gib": AT_LEAST_0,
    "audit.gib_per_nvcc_job": POSITIVE,
    "data.max_length": Range(2, 2**22),
    "data.num_workers": Range(0, 1024),
    "data.shard_rows": Range(1, 10**8),
    "data.min_loss_tokens": AT_LEAST_0,
    "data.max_degenerate_share": SHARE,
    "data.tool_call_repeat_limit": Range(1, 10**6),
    "generate.port": PORT,
    "generate.concurrency": Range(1, 65536),
    "generate.temperature": AT_LEAST_0,
    "generate.top_p": Range(0, 1, low_open=True),
    "generate.top_k": Range(-1),
    "generate.max_tokens": Range(1, 2**22),
    "generate.request_timeout_s": POSITIVE,
    "generate.retries": Range(0, 1000),
    "generate.max_server_restarts": Range(0, 1000),
    "generate.tp_size": Range(1, 1024),
    "generate.dp_size": Range(1, 1024),
    "generate.mem_fraction_static": Range(0, 1, low_open=True),
    "generate.vllm_cpu_kvcache_gib": Range(1, 16384),
    "generate.vllm_max_model_len": Range(0, 2**24),       # 0: generate.context_length, else the model's own
    "generate.flush_every": Range(1, 10**6),
    "generate.server_startup_timeout_s": POSITIVE,
    "generate.max_prompts": Range(0, 10**9),
    "generate.cb_num_blocks": Range(0, 10**8),
    "generate.server_threads": Range(0, 4096),
    "generate.context_length": Range(0, 2**24),
    "drafter.num_layers": Range(1, 1024),
    "drafter.block_size": Range(2, 4096),
    "drafter.sliding_window": Range(0, 2**24),            # 0: no window (>= 1 needed with a sliding layer: launch checks)
    "drafter.rope_scaling_factor": Range(1),         # > 1 with rope_scaling: launch checks
    "drafter.rope_original_max_position_embeddings": Range(0, 2**24),   # 0: max_position_embeddings
    "drafter.target_layer_ids": Range(0, 4096),
    "drafter.mask_token_id": Range(0, 2**31 - 1),
    "drafter.norm_init": POSITIVE,
    "drafter.draft_vocab_size": Range(0, 2**24),
    "drafter.num_attention_heads": Range(0, 4096),
    "drafter.num_key_value_heads": Range(0, 4096),
    "drafter.head_dim": Range(0, 4096),
    "drafter.rope_theta": Range(0, low_open=True, zero="the target's theta"),
    "drafter.conv_kernel_size": AT_LEAST_1,          # <= drafter.block_size (cross-field rule)
    "drafter.conv_group_size": AT_LEAST_1,           # divides the target's hidden size (launch checks)
    "drafter.selector_rank": AT_LEAST_1,
    "drafter.selector_top_k": AT_LEAST_1,            # <= the target's vocabulary (launch checks)
    "drafter.output_multiplier": POSITIVE,           # SGLang refuses a non-positive one; it keeps the top-K order
    "drafter.final_logit_softcapping": Range(0, low_open=True, zero="no softcapping"),
    "train.epochs": Range(1, 10**6),
    "train.max_steps": Range(0, 10**9),
    "train.lr": POSITIVE,
    "train.warmup_ratio": Range(0, 1, high_open=True),
    "train.weight_decay": AT_LEAST_0,
    "train.grad_clip": POSITIVE,
    "train.global_batch": Range(1, 2**20),
    "train.max_micro_batch": Range(1, 2**16),
    "train.num_anchors": Range(1, 2**16),
    "train.seed": Range(0, 2**63 - 1),
    "train.save_every_steps": Range(1, 10**9),
    "train.save_every_minutes": Range(0, 10**6, low_open=True, zero="by steps only (train.save_every_steps)"),
    "train.keep_checkpoints": Range(0, 10**6, zero="every checkpoint kept"),
    "train.log_every_steps": Range(1, 10**9),
    "train.max_restarts": Range(0, 1000),
    "train.decay_gamma": Range(0, low_open=True, zero="7 / 5 / 4 for block size 16 / 10 / 8"),
    "train.loss_chunk_rows": Range(1, 2**24),
    "train.heartbeat_timeout_s": Range(2, 86400),      # several beats per timeout (dflash.train.heartbeat)
    "train.collective_timeout_s": Range(10, 86400),
    "train.stuck_after_steps": Range(1, 1000),          # measured step times without progress (dflash.train.watchdog)
    "train.stuck_floor_s": Range(1, 86400),
    "train.selector_loss_alpha": AT_LEAST_0,         # 0: the selector's loss is computed (figures) but trains nothing
    "train.validation_share": Range(0, 1, high_open=True),    # 0: no validation; below 1: some rows must train
    "train.validation_every_steps": Range(1, 10**9, zero="at every checkpoint (train.save_every_steps)"),
    "memory.margin": Range(0, 1, high_open=True),
    "memory.overhead_mib": Range(0, 2**24),
    "eval.num_prompts": Range(1, 10**6),
    "eval.max_new_tokens": Range(1, 2**22),
    "eval.temperature": AT_LEAST_0,
    "eval.seed": Range(0, 2**63 - 1),
    "eval.prompt_lookup_max_ngram": Range(1, 1024),
    "eval.draft_tokens": Range(1, 4096, zero="the drafter's block_size - 1"),   # above block_size - 1: that many
    "eval.cpu_threads": Range(0, 4096),
    "eval.engine_port": PORT,
}


# The benchmarks `eval.benchmarks` may name (their prompts: dflash.prompts.benchmarks, which holds the same names).
BENCHMARK_NAMES = ("humaneval", "mt-bench", "gsm8k", "math500", "mbpp")


def cross_field_problems(profile: "Profile") -> list[tuple[str, str]]:
    """(dotted key, problem) for each rule between keys that needs no target model."""
    machine, train, data, drafter = profile.machine, profile.train, profile.data, profile.drafter
    world = machine.nproc_per_node * machine.nnodes
    problems = []
    if train.global_batch % world:
        problems.append(("train.global_batch", f"{train.global_batch} is not divisible by the {world} ranks "
                         f"(machine.nproc_per_node {machine.nproc_per_node} x machine.nnodes {machine.nnodes})"))
    if machine.gpu_count and machine.device == "cuda" and machine.nproc_per_node > machine.gpu_count:
        problems.append(("machine.nproc_per_node", f"{machine.nproc_per_node} ranks on a node with "
                         f"machine.gpu_count {machine.gpu_count}; valid: 1..{machine.gpu_count}"))
    if machine.nnodes > 1 and not machine.rdzv_endpoint:
        problems.append(("machine.rdzv_endpoint", f"machine.nnodes = {machine.nnodes} needs it (host:port "
                         "of the c10d rendezvous, reachable from every node)"))
    if data.min_loss_tokens >= data.max_length:
        problems.append(("data.min_loss_tokens", f"{data.min_loss_tokens} is not below data.max_length "
                         f"{data.max_length}: every sample would be degenerate"))
    if drafter.num_key_value_heads and drafter.num_attention_heads % drafter.num_key_value_heads:
        problems.append(("drafter.num_key_value_heads", f"{drafter.num_key_value_heads} does not divide "
                         f"drafter.num_attention_heads {drafter.num_attention_heads}"))
    if train.stuck_floor_s >= train.collective_timeout_s:
        problems.append(("train.stuck_floor_s", f"{train.stuck_floor_s:g} s is not below train.collective_timeout_s "
                         f"{train.collective_timeout_s:g} s: a stuck rank would never be named before the collective "
                         f"times out (valid: 1..{train.collective_timeout_s:g})"))
    unknown = [name for name in profile.eval.benchmarks if name not in BENCHMARK_NAMES]
    if unknown:
        problems.append(("eval.benchmarks", f"unknown benchmark(s) {', '.join(map(repr, unknown))}; "
                         f"valid: {', '.join(BENCHMARK_NAMES)}"))
    return problems + drafter_kind_problems(profile)


def drafter_kind_problems(profile: "Profile") -> list[tuple[str, str]]:
    """The DFlash 2 keys only with drafter.kind = "dflash2"; its head needs the whole vocabulary."""
    drafter, train = profile.drafter, profile.train
    if drafter.kind == "dflash":
        changed = [key for key, default in DFLASH2_DEFAULTS.items() if getattr(drafter, key) != default]
        changed = [f"drafter.{key}" for key in changed]
        changed += [key for key, moved in (("train.selector_loss_alpha", train.selector_loss_alpha != 1.0),
                                           ("train.selector_stop_gradient", train.selector_stop_gradient)) if moved]
        return [(key, "set, but drafter.kind is \"dflash\"; it applies to drafter.kind = \"dflash2\" only")
                for key in changed]
    problems = []
    if drafter.draft_vocab_size:
        problems.append(("drafter.draft_vocab_size", f"{drafter.draft_vocab_size} with drafter.kind = \"dflash2\": "
                         "its candidate selector and the engines that serve it (vLLM, SGLang) need the target's whole "
                         "vocabulary at the head; set drafter.draft_vocab_size = 0"))
    if drafter.conv_kernel_size > drafter.block_size:
        problems.append(("drafter.conv_kernel_size", f"{drafter.conv_kernel_size} taps exceed drafter.block_size "
                         f"{drafter.block_size}; the convolution stays inside a block (valid: 1..{drafter.block_size})"))
    if profile.machine.device == "cpu":      # vLLM 0.32's CPU build: V1 refuses candidate heads, V2 needs Triton's GPU backend
        for key, instead in (("eval.engine", "\"transformers\" (in-process)"), ("eval.serve_engine", "\"\"")):
            if getattr(profile.eval, key.split(".")[1]) == "vllm":
                problems.append((key, "\"vllm\" with drafter.kind = \"dflash2\" on CPU: vLLM's CPU build cannot serve "
                                 "a DFlash 2 drafter (its V1 model runner refuses candidate-head drafts, its V2 runner "
                                 f"needs Triton's GPU backend); set it to {instead}, or serve on a CUDA node"))
    return problems
