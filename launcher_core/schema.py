"""The profile schema: one frozen dataclass per TOML section, each rule declared once.

Every key is a field declared with `key(default, meaning, valid=Range(...))`: its type (checked
strictly by `launcher_core.profile`), its default (none: required), its meaning and, for a number,
its range live on the field itself. `Literal[...]` fields list their valid choices. The rules between
keys that need no target model are the `@cross_field_rule` functions below the sections, each naming
the keys it involves; the rules that need the target are `dflash.train.supervisor.launch_checks.LAUNCH_CHECKS`.
docs/profile-keys.md and docs/profile-rules.md are generated from all three (scripts/gen_docs_tables.py; a
test fails when they differ). Paths are strings, relative to the repository root unless absolute; `{run_dir}` in a path
expands to the profile's run directory.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

AttentionBackend = Literal["flashinfer", "fa3", "trtllm", "triton", "torch_sdpa"]


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


# Sizes and counts have an upper bound too, far above any real run and low enough that nothing sized by
# them (the plan's lists and lines, a rank's buffers, a pool of workers) grows without limit: 2**20
# sequences per optimizer step, 1024 ranks per node, 2**22 tokens per sequence.
AT_LEAST_0, AT_LEAST_1, POSITIVE = Range(0), Range(1), Range(0, low_open=True)
SHARE, PORT = Range(0, 1), Range(1, 65535)
DAY_S = 86400


def key(default: Any = dataclasses.MISSING, meaning: str = "", valid: Optional[Range] = None,
        dflash2: bool = False) -> Any:
    """A profile key: a dataclass field whose metadata holds its `meaning` (the docs' text), its
    `valid` Range (every int/float key has one: tests/safety/test_safety_profile.py holds it) and
    `dflash2` (the key applies to drafter.kind = "dflash2" only). No default: the key is required."""
    metadata: dict[str, Any] = {"meaning": meaning, "dflash2": dflash2}
    if valid is not None:
        metadata["valid"] = valid
    return field(default=default, metadata=metadata)


def section(cls: type, meaning: str) -> Any:
    """A `[section]` table of the profile (all its keys have defaults)."""
    return field(default_factory=cls, metadata={"meaning": meaning, "dflash2": False})


@dataclass(frozen=True)
class MachineSection:
    """What the node is and how ranks are launched on it."""

    device: Literal["cuda", "cpu"] = key(meaning="where the ranks compute")
    gpu_count: int = key(0, "GPUs the profile expects (0 on CPU)", Range(0, 1024))
    gpu_name: str = key("", "substring of the NVML name, e.g. \"RTX PRO 6000\"")
    gpu_memory_gib: float = key(0.0, "total memory per GPU", Range(0, 16384))
    compute_capability: str = key("", "\"12.0\" for SM120")
    cuda: str = key("", "torch CUDA tag the pins use, \"12.8\" / \"13.0\"; \"\" on CPU")
    requirements: str = key("requirements-cpu.txt", "the pinned requirements file the audit compares installed packages with")
    backend: Literal["nccl", "gloo"] = key("nccl", "torch.distributed backend of the ranks")
    nproc_per_node: int = key(1, "ranks on this node (torchrun --nproc-per-node)", Range(1, 1024))
    nnodes: int = key(1, "nodes of the run (torchrun --nnodes)", Range(1, 4096))
    rdzv_endpoint: str = key("", "host:port of the c10d rendezvous for nnodes > 1")
    bind_host: str = key("127.0.0.1", "where servers listen")


@dataclass(frozen=True)
class AuditSection:
    """Thresholds of the preflight audit (docs/audit.md)."""

    attention_backend: AttentionBackend = key("flashinfer", "SGLang --attention-backend; the audit checks it can run here")
    min_free_gib_per_gpu: float = key(0.0, "a GPU with less free memory fails the audit (gpu.free_memory)", AT_LEAST_0)
    baseline_free_tolerance_mib: int = key(128, "a GPU's free memory may drop this much below the saved baseline", AT_LEAST_0)
    baseline_context_tolerance_mib: int = key(64, "the CUDA context's cost may rise this much above the saved baseline", AT_LEAST_0)
    min_shm_gib: float = key(1.0, "least /dev/shm", AT_LEAST_0)
    min_disk_gib: float = key(10.0, "least free disk where the run writes (its run directory)", AT_LEAST_0)
    min_ram_gib: float = key(4.0, "least RAM (cgroup limit applied)", AT_LEAST_0)
    gib_per_nvcc_job: float = key(5.0, "RAM an nvcc job takes, for the MAX_JOBS the audit recommends", POSITIVE)


@dataclass(frozen=True)
class ModelSection:
    """The target model."""

    target: str = key(meaning="a local model directory, or `builtin:smollm2-135m-instruct`")
    tokenizer: str = key("", "its tokenizer; \"\": the target's directory")
    dtype: Literal["bfloat16", "float16", "float32"] = key("bfloat16", "the target's weights and activations")


@dataclass(frozen=True)
class PathsSection:
    """Where a run's files are."""

    run_dir: str = key("runs/{profile}", "the run directory; {profile}: the profile's name")
    prompts: str = key("{run_dir}/prompts.jsonl", "prompts that generate reads")
    completions: str = key("{run_dir}/completions.jsonl", "completions that generate writes and tokenize reads")
    dataset: str = key("{run_dir}/dataset", "the tokenized training dataset")
    eval_prompts: str = key("", "eval's prompts; \"\": the built-in out-of-template held-out set")


@dataclass(frozen=True)
class DataSection:
    """Tokenization and data-quality gates."""

    max_length: int = key(8192, "tokens a sample is cut to", Range(2, 2**22))
    num_workers: int = key(0, "tokenizer processes (0: one per core)", Range(0, 1024))
    shard_rows: int = key(20000, "rows per dataset shard file", Range(1, 10**8))
    min_loss_tokens: int = key(16, "fewer loss tokens is degenerate (the seeds' 6-token empties)", AT_LEAST_0)
    max_degenerate_share: float = key(0.05, "above this share of rejected records and degenerate samples tokenize fails (exit 4)", SHARE)
    tool_call_repeat_limit: int = key(8, "one identical tool call this many times in a turn is degenerate", Range(1, 10**6))
    rewritten_turns: Literal["split", "context"] = key("split", "turns the template rewrites later: own sample, or context only")


@dataclass(frozen=True)
class GenerateSection:
    """Generating the training completions with the target (docs/generate.md)."""

    backend: Literal["sglang", "transformers", "endpoint", "vllm"] = key("sglang", "what serves the target")
    port: int = key(30000, "where the target's server listens", PORT)
    concurrency: int = key(256, "requests in flight", Range(1, 65536))
    temperature: float = key(0.6, "sampling temperature", AT_LEAST_0)
    top_p: float = key(0.95, "nucleus sampling", Range(0, 1, low_open=True))
    top_k: int = key(20, "top-k sampling (-1: off)", Range(-1))
    max_tokens: int = key(8192, "tokens per completion, at most", Range(1, 2**22))
    thinking: bool = key(True, "the chat template's thinking mode")
    request_timeout_s: float = key(600.0, "a request not answered in this time is sent again", POSITIVE)
    retries: int = key(3, "times a failed request is sent again", Range(0, 1000))
    max_server_restarts: int = key(3, "times a server that died is restarted", Range(0, 1000))
    tp_size: int = key(1, "SGLang --tp-size", Range(1, 1024))
    dp_size: int = key(1, "SGLang --dp-size", Range(1, 1024))
    mem_fraction_static: float = key(0.85, "SGLang --mem-fraction-static (vLLM --gpu-memory-utilization)", Range(0, 1, low_open=True))
    reasoning_parser: str = key("qwen3", "SGLang --reasoning-parser (\"\": none)")
    flush_every: int = key(32, "completions written to disk together", Range(1, 10**6))
    tool_call_parser: str = key("", "SGLang --tool-call-parser (e.g. \"qwen25\"); \"\" leaves tool calls in content")
    server_startup_timeout_s: float = key(900.0, "how long a started server may take to answer /health", POSITIVE)
    max_prompts: int = key(0, "use only the first N prompts of paths.prompts (0: all)", Range(0, 10**9))
    continuous_batching: bool = key(False, "transformers serve --continuous-batching (one batched forward)")
    cb_num_blocks: int = key(0, "its KV cache in blocks of 256 tokens (0: sized from free memory)", Range(0, 10**8))
    server_threads: int = key(0, "OMP_NUM_THREADS of a CPU server (0: transformers serve 1 unless already set, "
                                 "vLLM torch's default)", Range(0, 4096))
    context_length: int = key(0, "SGLang --context-length (prompt + completion); 0: the model's own", Range(0, 2**24))
    vllm_cpu_kvcache_gib: int = key(2, "vLLM on CPU: VLLM_CPU_KVCACHE_SPACE, GiB of RAM for its KV cache (on CPU it "
                                       "takes no --gpu-memory-utilization share)", Range(1, 16384))
    vllm_max_model_len: int = key(0, "vLLM --max-model-len (0: generate.context_length, else the model's own)", Range(0, 2**24))
    vllm_enforce_eager: bool = key(False, "vLLM --enforce-eager: starts in ~30 s on CPU instead of 100-140 s of compile")


DrafterKind = Literal["dflash", "dflash2"]


@dataclass(frozen=True)
class DrafterSection:
    """The drafter (docs/drafter.md, "Drafter shape", "Drafter layers", "DFlash 2"). Its attention shape and
    RoPE are its own; 0 derives them from the target: head dim min(target's, 128), the target's query/KV
    widths, plain RoPE at the target's theta. The DFlash 2 keys (kind = "dflash2") default to the published
    values: z-lab's Qwen3.8-27B-DFlash2 and SpecForge's configs/qwen3.6-27b-dflash2.json (kernel 2, groups
    of 16 channels, rank 256, top-16), the defaults of vLLM Speculators' `dflash2` (PR #1006); a unit
    multiplier and no softcap as the reference `DFlash2DraftModel.compute_logits` reads their absence."""

    kind: DrafterKind = key("dflash", "dflash2: the causal convolutions and the candidate selector (DFlash2DraftModel)")
    num_layers: int = key(5, "draft decoder layers", Range(1, 1024))
    block_size: int = key(16, "tokens a block drafts: the anchor and block_size - 1 masks", Range(2, 4096))
    target_layer_ids: tuple[int, ...] = key((), "the target layers whose outputs feed the drafter; empty: spaced "
                                                "from layer 1 to N-3 (dflash.drafter.taps)", Range(0, 4096))
    mask_token_id: Optional[int] = key(None, "the token of a block's masked slots; unset: the tokenizer's mask "
                                             "token, else an error", Range(0, 2**31 - 1))
    norm_init: float = key(1.0, "final norm's start: its weight (random init), a factor on the target's (target init)", POSITIVE)
    init: Literal["random", "target", "drafter"] = key("random", "target: layers start as the target's layers after "
                                                                 "the deepest tap; drafter: from init_from")
    draft_vocab_size: int = key(0, "0: the target's vocabulary; N: only the N most frequent training tokens", Range(0, 2**24))
    num_attention_heads: int = key(0, "query heads (0: the target's query width / head_dim)", Range(0, 4096))
    num_key_value_heads: int = key(0, "key/value heads (0: the target's KV width / head_dim)", Range(0, 4096))
    head_dim: int = key(0, "<= 128 on SM12x: flex_attention's bf16 backward runs out of shared memory above "
                           "(0: min(target's, 128))", Range(0, 4096))
    rope_theta: float = key(0.0, "plain RoPE base, written as top-level `rope_theta` in config.json",
                            Range(0, low_open=True, zero="the target's theta"))
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] = key(
        (), "per layer; empty: every layer full_attention")
    sliding_window: int = key(0, "positions a sliding_attention layer sees back (causal, as published); 0: no window",
                              Range(0, 2**24))
    rope_scaling: Literal["none", "linear", "yarn"] = key("none", "RoPE scaling of the drafter's layers")
    rope_scaling_factor: float = key(1.0, "its factor", Range(1))
    rope_original_max_position_embeddings: int = key(0, "yarn: the context the RoPE was made for "
                                                        "(0: max_position_embeddings)", Range(0, 2**24))
    init_from: str = key("", "init = \"drafter\": a DFlash drafter directory (z-lab format) or our checkpoint")
    conv_kernel_size: int = key(2, "taps of the grouped dynamic causal convolution around every attention and MLP "
                                   "sublayer", AT_LEAST_1, dflash2=True)
    conv_group_size: int = key(16, "channels that share one dynamic kernel", AT_LEAST_1, dflash2=True)
    selector_rank: int = key(256, "rank of the candidate selector's predecessor/successor codebooks", AT_LEAST_1,
                             dflash2=True)
    selector_top_k: int = key(16, "the head's top tokens per slot the selector re-ranks", AT_LEAST_1, dflash2=True)
    output_multiplier: float = key(1.0, "the unary logits are lm_head x this (SGLang refuses a non-positive one; "
                                        "it keeps the top-K order)", POSITIVE, dflash2=True)
    final_logit_softcapping: float = key(0.0, "the unary logits tanh-softcapped at this",
                                         Range(0, low_open=True, zero="no softcapping"), dflash2=True)


@dataclass(frozen=True)
class TrainSection:
    """Training the drafter (docs/train.md)."""

    epochs: int = key(6, "passes over the dataset", Range(1, 10**6))
    max_steps: int = key(0, "optimizer steps at most (0: run all epochs)", Range(0, 10**9))
    lr: float = key(6e-4, "AdamW peak learning rate (cosine schedule)", POSITIVE)
    warmup_ratio: float = key(0.04, "share of the steps the learning rate warms up", Range(0, 1, high_open=True))
    weight_decay: float = key(0.0, "AdamW weight decay", AT_LEAST_0)
    grad_clip: float = key(1.0, "gradient norm clipped to this", POSITIVE)
    max_skipped_steps: int = key(8, "steps without a supervised position in a row that are skipped (counted in "
                                    "metrics.jsonl and the manifest); one more stops the run, exit 4 (0: the first stops "
                                    "it)", Range(0, 10**6))
    global_batch: int = key(64, "sequences per optimizer step, across all ranks", Range(1, 2**20))
    max_micro_batch: int = key(4, "sequences per forward on one rank, at most", Range(1, 2**16))
    num_anchors: int = key(512, "blocks per sequence and step, at most", Range(1, 2**16))
    seed: int = key(0, "seed of the drafter's initialisation, the rows' order and the validation split", Range(0, 2**63 - 1))
    attention: Literal["auto", "flex", "sdpa"] = key("auto", "the drafter's attention kernel")
    save_every_steps: int = key(500, "a checkpoint every N steps", Range(1, 10**9))
    save_every_minutes: float = key(0.0, "also a checkpoint once this many minutes have passed since the last: "
                                         "bounds in time the work a restart loses",
                                    Range(0, 10**6, low_open=True, zero="by steps only (train.save_every_steps)"))
    async_save: bool = key(True, "checkpoint shards written by a thread while the ranks train on "
                                 "(DCP async_save; dflash.train.rank.sharded_checkpoints)")
    keep_checkpoints: int = key(3, "the newest N checkpoints kept, with the best by held-out tau and the latest "
                                   "(dflash.train.rank.retention): at most N + 2 on disk, which train holds against "
                                   "the free disk before it starts", Range(0, 10**6, zero="every checkpoint kept"))
    log_every_steps: int = key(10, "a metrics line every N steps", Range(1, 10**9))
    max_restarts: int = key(0, "torchrun --max-restarts", Range(0, 1000))
    rank_start: Literal["forkserver", "command"] = key(
        "forkserver", "forkserver: ranks forked from torchrun's forkserver, which imports torch and the model code "
                      "once; command: each rank a new python (`-m dflash.train.rank.worker`) that imports them itself")
    decay_gamma: float = key(0.0, "loss decay exp(-(k-1)/gamma)",
                             Range(0, low_open=True, zero="7 / 5 / 4 for block size 16 / 10 / 8"))
    loss: Literal["ce", "dpace", "distill"] = key(
        "ce", "the objective (docs/drafter.md \"The loss\"): ce, hard-label cross entropy weighted by the decay "
              "(SpecForge 0.2.0's); dpace, the same cross entropy weighted by D-PACE's per-position weights "
              "(SpecForge PR #578, Speculators' default since PR #980); distill, KL from the target's own "
              "next-token distribution at each slot, weighted by the decay (the target runs to its last layer)")
    dpace_alpha: float = key(0.5, "train.loss = \"dpace\": the confidence smoothing q~ = (1 - alpha) q + alpha "
                                  "(SpecForge, Speculators, Model-Optimizer: 0.5)", Range(0, 1, low_open=True))
    loss_chunk_rows: int = key(2048, "drafter logits rows per chunk (vocab-sized rows)", Range(1, 2**24))
    autocast: Literal["auto", "bfloat16", "off"] = key("auto", "drafter forward: auto = bf16 on CUDA, fp32 on CPU")
    compute_dtype: Literal["float32", "bfloat16"] = key("float32", "drafter's residual stream and norms "
                                                                   "(bf16: on bf16 weight copies)")
    feature_cache: bool = key(False, "each row's tap features extracted once, kept as files for later epochs")
    reshard_after_forward: bool = key(True, "FSDP2 (docs/sharding.md): draft layers' gathered "
                                            "weights freed after forward, gathered again in backward (false: kept "
                                            "from forward to backward, FSDP1's SHARD_GRAD_OP)")
    gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = key(
        "every_micro_batch", "reduce-scatter each micro-batch's gradients (sharded accumulation), or hold unsharded "
                             "ones until the last")
    activation_checkpointing: Literal["none", "layers"] = key("none", "layers: each draft layer's activations "
                                                                      "recomputed in backward")
    heartbeat_timeout_s: float = key(120.0, "a rank whose process stops beating this long is named and the run "
                                            "ended (several beats per timeout: dflash.train.supervisor.heartbeat)", Range(2, DAY_S))
    collective_timeout_s: float = key(600.0, "the process group's timeout: a collective waits this long for a rank",
                                      Range(10, DAY_S))
    stuck_after_steps: float = key(5.0, "a rank that holds the others this many measured step times is named "
                                        "(dflash.train.supervisor.watchdog)", Range(1, 1000))
    stuck_floor_s: float = key(120.0, "the least time without progress before a rank is named stuck", Range(1, DAY_S))
    selector_loss_alpha: float = key(1.0, "loss = DFlash loss on the unary logits + alpha x the selector's K-way "
                                          "cross entropy (SpecForge PR #772, vLLM Speculators PR #1006: 1.0); 0: "
                                          "computed for the figures, trains nothing", AT_LEAST_0, dflash2=True)
    selector_stop_gradient: bool = key(False, "the selector term trains only the selector, not the backbone it reads "
                                              "(SpecForge PR #793, off)", dflash2=True)
    validation_share: float = key(0.0, "share of the dataset's rows held out of training and measured on (0: none; "
                                       "below 1: some rows must train)", Range(0, 1, high_open=True))
    validation_every_steps: int = key(0, "held-out loss and tau every N steps and at the end",
                                      Range(1, 10**9, zero="at every checkpoint (train.save_every_steps)"))


@dataclass(frozen=True)
class MemorySection:
    """The memory plan (docs/plan.md)."""

    margin: float = key(0.10, "fraction of free memory held back", Range(0, 1, high_open=True))
    overhead_mib: int = key(0, "non-torch overhead if not measured (0: from probe/baseline)", Range(0, 2**24))
    expandable_segments: bool = key(True, "CUDA ranks' caching allocator grows segments instead of fragmenting fixed "
                                          "ones (envcheck.allocator: the user's own PYTORCH_ALLOC_CONF / "
                                          "PYTORCH_CUDA_ALLOC_CONF is completed, an explicit setting kept)")


@dataclass(frozen=True)
class EvalSection:
    """Speculative-decoding evaluation (docs/eval.md)."""

    num_prompts: int = key(32, "prompts decoded", Range(1, 10**6))
    max_new_tokens: int = key(256, "tokens decoded per prompt, at most", Range(1, 2**22))
    temperature: float = key(0.0, "sampling temperature (0: greedy)", AT_LEAST_0)
    seed: int = key(0, "sampling seed (temperature > 0)", Range(0, 2**63 - 1))
    prompt_lookup_max_ngram: int = key(3, "the n-gram baseline's longest suffix match", Range(1, 1024))
    draft_tokens: int = key(0, "DFlash draft tokens a step proposes, the target verifies k + 1 (in-process and "
                               "served: vLLM num_speculative_tokens); above block_size - 1: that many",
                            Range(1, 4096, zero="the drafter's block_size - 1"))
    cpu_threads: int = key(1, "torch threads when decoding on CPU (0: torch's default); more threads stall small "
                              "batch-1 forwards on a busy CPU", Range(0, 4096))
    cpu_matmul: Literal["auto", "torch"] = key("auto", "float32 on CPU: auto = the faster kernel per row count for "
                                                       "every linear layer (dflash.eval.cpu_kernels); torch = nn.Linear as is")
    engine: Literal["transformers", "sglang", "vllm"] = key("transformers", "who decodes: in-process, or the serving engine")
    engine_python: str = key("", "python of the environment with the engine (\"\": this one)")
    engine_port: int = key(30100, "where the engine eval's servers listen (127.0.0.1); a free port when another eval claimed it or it is taken", PORT)
    also_prompts: tuple[str, ...] = key((), "more prompt sets measured beside the default one (not with --prompts), "
                                            "each reported apart and labelled (eval/<file stem>/)")
    serve_engine: Literal["", "sglang", "vllm"] = key("", "the engine that will serve the drafter: the pipeline runs "
                                                          "`eval --engine` with it after the in-process eval (served vs "
                                                          "in-process tau)")
    benchmarks: tuple[str, ...] = key((), "benchmarks decoded beside the default set (`--bench`), one row each, "
                                          "eval/bench/<name>/")
    bench_dir: str = key("", "local copies of gsm8k, math500, mbpp (DIR/<name>/<split>.jsonl or a save_to_disk "
                             "folder DIR/<name>/); \"\": the hub or its cache")
    bench_samples: int = key(0, "samples of each benchmark, z-lab's order (MT-Bench decodes both turns of each "
                                "in-process); `--num-prompts` caps it", Range(1, 10**6, zero="eval.num_prompts"))
    serve_benchmarks: bool = key(True, "the pipeline's served check (eval.serve_engine) decodes eval.benchmarks' first "
                                       "turns too, each benchmark on its own engine starts")


@dataclass(frozen=True)
class Profile:
    name: str = key(meaning="the profile file's stem (set by the loader, not a key of the file)")
    machine: MachineSection = key(meaning="[machine] (required)")
    model: ModelSection = key(meaning="[model] (required)")
    description: str = key("", "one line shown by `launcher.py profiles`")
    audit: AuditSection = section(AuditSection, "[audit]")
    paths: PathsSection = section(PathsSection, "[paths]")
    data: DataSection = section(DataSection, "[data]")
    generate: GenerateSection = section(GenerateSection, "[generate]")
    drafter: DrafterSection = section(DrafterSection, "[drafter]")
    train: TrainSection = section(TrainSection, "[train]")
    memory: MemorySection = section(MemorySection, "[memory]")
    eval: EvalSection = section(EvalSection, "[eval]")


# Keys that profiles once had: a profile that still sets one is told what replaced it.
REMOVED_KEYS: dict[str, str] = {
    "train.optimizer_sharding": "the drafter's parameters, gradients and AdamW states are now always sharded over the "
                                "ranks by FSDP2 (fully_shard); delete the key (train.reshard_after_forward = false keeps "
                                "the gathered weights from forward to backward, as SHARD_GRAD_OP)",
    "train.grad_bucket_mib": "gradients are reduced by FSDP2's reduce-scatter, not by buckets of ours; delete the key",
}


def _section_keys() -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(Profile)
    return {f"{part.name}.{spec.name}": spec for part in dataclasses.fields(Profile)
            if dataclasses.is_dataclass(hints[part.name]) for spec in dataclasses.fields(hints[part.name])}


# dotted key -> its field (type, default, metadata: meaning, valid, dflash2), in the order of the sections.
KEYS: dict[str, dataclasses.Field] = _section_keys()
# dotted key -> Range, read from the fields (the loader reads each field's own).
RANGES: dict[str, Range] = {dotted: spec.metadata["valid"] for dotted, spec in KEYS.items() if "valid" in spec.metadata}
# The keys of drafter.kind = "dflash2" only, and their published values.
DFLASH2_KEYS: tuple[str, ...] = tuple(dotted for dotted, spec in KEYS.items() if spec.metadata["dflash2"])
DFLASH2_DEFAULTS: dict[str, Any] = {dotted.split(".")[1]: KEYS[dotted].default for dotted in DFLASH2_KEYS
                                    if dotted.startswith("drafter.")}

# The benchmarks `eval.benchmarks` may name (their prompts: dflash.prompts.benchmarks, which holds the same names).
BENCHMARK_NAMES = ("humaneval", "mt-bench", "gsm8k", "math500", "mbpp")


# --- rules between keys that need no target model: checked by launcher_core.profile for every source ----------

Problems = list[tuple[str, str]]        # (dotted key, what is wrong and what is valid)


@dataclass(frozen=True)
class CrossFieldRule:
    """One rule between keys: `check(profile)` -> its problems; `keys` it involves (docs/profile-rules.md)."""

    name: str
    keys: tuple[str, ...]
    description: str
    check: Callable[[Profile], Problems]


CROSS_FIELD_RULES: list[CrossFieldRule] = []     # in the order they are checked (the first problem is the error)


def cross_field_rule(*keys: str, description: str) -> Callable[[Callable[[Profile], Problems]], Callable[[Profile], Problems]]:
    """Declares the decorated `check(profile) -> problems` as a rule over `keys`, described for the docs."""
    def register(check: Callable[[Profile], Problems]) -> Callable[[Profile], Problems]:
        CROSS_FIELD_RULES.append(CrossFieldRule(check.__name__, keys, description, check))
        return check
    return register


def cross_field_problems(profile: Profile) -> Problems:
    """(dotted key, problem) for each rule between keys that needs no target model."""
    return [problem for rule in CROSS_FIELD_RULES for problem in rule.check(profile)]


@cross_field_rule("train.global_batch", "machine.nproc_per_node", "machine.nnodes",
                  description="train.global_batch is divisible by the ranks (machine.nproc_per_node x machine.nnodes)")
def global_batch_divides(profile: Profile) -> Problems:
    machine = profile.machine
    problem = batch_split_problem(profile.train.global_batch, machine.nproc_per_node * machine.nnodes)
    if problem is None:
        return []
    return [("train.global_batch", f"{problem} (machine.nproc_per_node {machine.nproc_per_node} x machine.nnodes "
             f"{machine.nnodes})")]


def batch_split_problem(global_batch: int, world_size: int) -> Optional[str]:
    """The rule global_batch_divides declares, on plain numbers (the launch plan checks its world size with it):
    every rank runs the same number of sequences a step."""
    if global_batch > 0 and global_batch % world_size == 0:
        return None
    return f"{global_batch} is not a positive multiple of the {world_size} ranks (every rank runs the same share)"


@cross_field_rule("machine.nproc_per_node", "machine.gpu_count", "machine.device",
                  description="on CUDA with machine.gpu_count set, at most one rank per GPU")
def ranks_fit_gpus(profile: Profile) -> Problems:
    machine = profile.machine
    if not (machine.gpu_count and machine.device == "cuda" and machine.nproc_per_node > machine.gpu_count):
        return []
    return [("machine.nproc_per_node", f"{machine.nproc_per_node} ranks on a node with "
             f"machine.gpu_count {machine.gpu_count}; valid: 1..{machine.gpu_count}")]


@cross_field_rule("machine.rdzv_endpoint", "machine.nnodes",
                  description="several nodes need the rendezvous endpoint")
def nodes_have_rendezvous(profile: Profile) -> Problems:
    machine = profile.machine
    if machine.nnodes <= 1 or machine.rdzv_endpoint:
        return []
    return [("machine.rdzv_endpoint", f"machine.nnodes = {machine.nnodes} needs it (host:port "
             "of the c10d rendezvous, reachable from every node)")]


@cross_field_rule("data.min_loss_tokens", "data.max_length",
                  description="data.min_loss_tokens is below data.max_length (else every sample is degenerate)")
def loss_tokens_fit_length(profile: Profile) -> Problems:
    data = profile.data
    if data.min_loss_tokens < data.max_length:
        return []
    return [("data.min_loss_tokens", f"{data.min_loss_tokens} is not below data.max_length "
             f"{data.max_length}: every sample would be degenerate")]


@cross_field_rule("drafter.num_key_value_heads", "drafter.num_attention_heads", "drafter.head_dim",
                  description="drafter.num_key_value_heads divides drafter.num_attention_heads, and drafter.head_dim "
                              "is even (RoPE rotates pairs): the keys set here, and the shape derived from the target "
                              "for those left 0")
def attention_shape_fits(profile: Profile) -> Problems:
    drafter = profile.drafter
    return attention_shape_problems(drafter.num_attention_heads, drafter.num_key_value_heads, drafter.head_dim)


def attention_shape_problems(heads: int, kv_heads: int, head_dim: int) -> Problems:
    """The rule attention_shape_fits declares, on plain numbers (0: not set, derived from the target later;
    dflash.drafter.shape checks the derived shape with it): whole query groups per KV head, an even head dim."""
    problems: Problems = []
    if heads and kv_heads and heads % kv_heads:
        problems.append(("drafter.num_key_value_heads", f"{kv_heads} does not divide drafter.num_attention_heads "
                                                        f"{heads}"))
    if head_dim % 2:
        problems.append(("drafter.head_dim", f"{head_dim} is odd; valid: an even number (RoPE rotates pairs)"))
    return problems


@cross_field_rule("train.stuck_floor_s", "train.collective_timeout_s",
                  description="train.stuck_floor_s is below train.collective_timeout_s, so a stuck rank is named "
                              "before the collective times out")
def stuck_rank_named_in_time(profile: Profile) -> Problems:
    train = profile.train
    if train.stuck_floor_s < train.collective_timeout_s:
        return []
    return [("train.stuck_floor_s", f"{train.stuck_floor_s:g} s is not below train.collective_timeout_s "
             f"{train.collective_timeout_s:g} s: a stuck rank would never be named before the collective "
             f"times out (valid: 1..{train.collective_timeout_s:g})")]


@cross_field_rule("eval.benchmarks", description=f"eval.benchmarks names known benchmarks: {', '.join(BENCHMARK_NAMES)}")
def benchmarks_known(profile: Profile) -> Problems:
    unknown = [name for name in profile.eval.benchmarks if name not in BENCHMARK_NAMES]
    if not unknown:
        return []
    return [("eval.benchmarks", f"unknown benchmark(s) {', '.join(map(repr, unknown))}; "
             f"valid: {', '.join(BENCHMARK_NAMES)}")]


def _value(profile: Profile, dotted: str) -> Any:
    section_name, name = dotted.split(".")
    return getattr(getattr(profile, section_name), name)


@cross_field_rule("drafter.kind", *DFLASH2_KEYS,
                  description="the DFlash 2 keys keep their defaults unless drafter.kind = \"dflash2\"")
def dflash2_keys_need_dflash2(profile: Profile) -> Problems:
    if profile.drafter.kind != "dflash":
        return []
    return [(dotted, "set, but drafter.kind is \"dflash\"; it applies to drafter.kind = \"dflash2\" only")
            for dotted in DFLASH2_KEYS if _value(profile, dotted) != KEYS[dotted].default]


@cross_field_rule("drafter.draft_vocab_size", "drafter.kind",
                  description="drafter.kind = \"dflash2\" needs the target's whole vocabulary at the head "
                              "(drafter.draft_vocab_size = 0)")
def dflash2_whole_vocabulary(profile: Profile) -> Problems:
    drafter = profile.drafter
    if drafter.kind != "dflash2" or not drafter.draft_vocab_size:
        return []
    return [("drafter.draft_vocab_size", f"{drafter.draft_vocab_size} with drafter.kind = \"dflash2\": "
             "its candidate selector and the engines that serve it (vLLM, SGLang) need the target's whole "
             "vocabulary at the head; set drafter.draft_vocab_size = 0")]


@cross_field_rule("drafter.conv_kernel_size", "drafter.block_size", "drafter.kind",
                  description="drafter.kind = \"dflash2\": the convolution's taps stay inside a block "
                              "(drafter.conv_kernel_size <= drafter.block_size)")
def dflash2_kernel_in_block(profile: Profile) -> Problems:
    drafter = profile.drafter
    if drafter.kind != "dflash2" or drafter.conv_kernel_size <= drafter.block_size:
        return []
    return [("drafter.conv_kernel_size", f"{drafter.conv_kernel_size} taps exceed drafter.block_size "
             f"{drafter.block_size}; the convolution stays inside a block (valid: 1..{drafter.block_size})")]


@cross_field_rule("eval.engine", "eval.serve_engine", "drafter.kind", "machine.device",
                  description="drafter.kind = \"dflash2\" on CPU: no vLLM engine (its CPU build cannot serve "
                              "a DFlash 2 drafter)")
def dflash2_not_on_cpu_vllm(profile: Profile) -> Problems:
    # vLLM 0.32's CPU build: V1 refuses candidate heads, V2 needs Triton's GPU backend
    if profile.drafter.kind != "dflash2" or profile.machine.device != "cpu":
        return []
    return [(dotted, "\"vllm\" with drafter.kind = \"dflash2\" on CPU: vLLM's CPU build cannot serve "
             "a DFlash 2 drafter (its V1 model runner refuses candidate-head drafts, its V2 runner "
             f"needs Triton's GPU backend); set it to {instead}, or serve on a CUDA node")
            for dotted, instead in (("eval.engine", "\"transformers\" (in-process)"), ("eval.serve_engine", "\"\""))
            if _value(profile, dotted) == "vllm"]


@cross_field_rule("train.loss", "train.dpace_alpha", "train.feature_cache", "drafter.kind",
                  description="train.loss other than \"ce\" trains a DFlash drafter (drafter.kind = \"dflash\"); "
                              "\"distill\" runs the target every step (train.feature_cache off); train.dpace_alpha "
                              "keeps its default unless train.loss = \"dpace\"")
def loss_fits_the_run(profile: Profile) -> Problems:
    train = profile.train
    if train.loss != "ce" and profile.drafter.kind != "dflash":
        return [("train.loss", f"\"{train.loss}\" with drafter.kind = \"{profile.drafter.kind}\"; valid there: \"ce\"")]
    if train.loss == "distill" and train.feature_cache:
        return [("train.feature_cache", "true with train.loss = \"distill\": the loss needs the target's last layer "
                 "every step, which the cache does not keep; set train.feature_cache = false")]
    if train.loss != "dpace" and train.dpace_alpha != KEYS["train.dpace_alpha"].default:
        return [("train.dpace_alpha", f"set, but train.loss is \"{train.loss}\"; it applies to train.loss = \"dpace\" only")]
    return []
