"""`eval`: decode held-out prompts with the target alone, with the trained DFlash drafter and with
prompt lookup (same block size), and write the report, the plots and the manifest's eval entry."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from dflash.eval.options import EvalOptions, EvalSummary, also_prompt_paths, bench_dir, bench_sample_count, benchmark_names, benchmark_prompts_file, eval_prompts_path, prompt_set_label
from dflash.eval.report_schema import TARGET, EvalReport, ReportContext, SetBrief
from launcher_core.errors import InputError
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from dflash.eval.dflash_drafter import DFlashDraft
    from dflash.eval.report_writer import PromptRuns
    from dflash.eval.specdec import DecodeSettings, Drafter, TargetVerifier
    from dflash.prompts.benchmarks import BenchPrompt


@dataclass
class EncodedPrompt:
    prompt_id: str
    token_ids: list[int]


def resolve_checkpoint(run_dir: Path, checkpoint: Optional[str]) -> Path:
    """An explicit checkpoint must exist; otherwise the run's latest checkpoint."""
    from dflash.drafter.checkpoint_files import latest_checkpoint

    if checkpoint:
        path = Path(checkpoint)
        if not path.exists():
            raise InputError(f"--draft {checkpoint}: no such checkpoint directory")
        return path
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise InputError(f"{run_dir}: no drafter checkpoint yet; train first (launcher.py train) or pass --draft DIR")
    return latest


def encode_prompts(tokenizer: PreTrainedTokenizerBase, path: Path, count: int, thinking: bool) -> list[EncodedPrompt]:
    """The first `count` prompts, rendered with the chat template and a generation prompt."""
    from dflash.generate.prompt_files import load_prompts

    return [encode_messages(tokenizer, record.id, list(record.messages), thinking, list(record.tools))
            for record in load_prompts(path)[:count]]


def encode_messages(tokenizer: PreTrainedTokenizerBase, prompt_id: str, messages: list, thinking: bool,
                    tools: Optional[list] = None) -> EncodedPrompt:
    """One conversation rendered with the chat template and a generation prompt, then tokenized."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None,  # tool calls render too
                                         add_generation_prompt=True, tokenize=False, enable_thinking=thinking)
    return EncodedPrompt(prompt_id, list(tokenizer(str(text), add_special_tokens=False)["input_ids"]))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> tuple[int, ...]:
    ids: set[Optional[int]] = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return tuple(sorted(i for i in ids if i is not None))


def load_target(profile: Profile) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path]:
    """The target (straight onto the GPU on a CUDA profile), its tokenizer and its directory."""
    from typing import cast

    import torch

    from dflash.target_model import load_target as load_model
    from dflash.target_model import resolve_model_path
    from dflash.tokenizer import load_tokenizer, tokenizer_dir_for

    path = resolve_model_path(profile.model.target)
    device = "cuda" if profile.machine.device == "cuda" and torch.cuda.is_available() else "cpu"
    model = cast("PreTrainedModel", load_model(path, device=device, dtype=profile.model.dtype))
    return model, load_tokenizer(tokenizer_dir_for(profile)), path


def prepare_cpu_decoding(profile: Profile, model: PreTrainedModel, draft: DFlashDraft) -> int:
    """eval.cpu_matmul = "auto": the target's and the drafter's linear layers on a float32 CPU run
    the faster kernel per row count (dflash.eval.cpu_kernels), for every decoding method alike;
    returns how many layers were switched (0 on a GPU or another dtype, or with "torch")."""
    if profile.eval.cpu_matmul != "auto":
        return 0
    from dflash.eval.cpu_kernels import use_fast_cpu_linears

    draft.model.requires_grad_(False)
    return use_fast_cpu_linears(model) + use_fast_cpu_linears(draft.model) + use_fast_cpu_linears(draft.head())


@contextlib.contextmanager
def cpu_threads(model: PreTrainedModel, threads: int) -> Iterator[None]:
    """Decoding on CPU: a fixed thread count for every method (0 keeps torch's default); restored after."""
    import torch

    previous = torch.get_num_threads()
    if threads > 0 and next(model.parameters()).device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def decode_prompts(model: PreTrainedModel, drafters: Sequence[Drafter], prompts: Sequence[EncodedPrompt],
                   settings: DecodeSettings, seed: int, layer_ids: Sequence[int], warm_up: bool = True) -> list[PromptRuns]:
    """Every prompt with target-only decoding and each drafter, in turn (same machine state); `warm_up`
    False: no short decode first (the methods ran just before)."""
    import torch
    from tqdm import tqdm

    from dflash.eval.report_writer import MethodRun, PromptRuns
    from dflash.eval.specdec import NoDrafter, TargetVerifier, speculative_decode

    verifier = TargetVerifier(model, layer_ids)
    methods: list[Drafter] = [NoDrafter(), *drafters]
    if warm_up:
        _warm_up(verifier, methods, prompts[0].token_ids, settings)
    results = []
    for prompt in tqdm(prompts, desc="eval", unit="prompt"):
        entry = PromptRuns(prompt.prompt_id, len(prompt.token_ids))
        for method in methods:
            generator = torch.Generator().manual_seed(seed)
            if hasattr(method, "generator"):       # a sampling drafter (DFlashDraft) gets its own seeded stream
                setattr(method, "generator", torch.Generator().manual_seed(seed + 1))
            run = speculative_decode(verifier, method, prompt.token_ids, settings, generator=generator)
            entry.runs[method.name] = MethodRun(run.tokens, run.taus, run.wall_s, run.draft_margins, run.target_margins,
                                                 run.drafts)
        results.append(entry)
    return results


def _warm_up(verifier: TargetVerifier, methods: Sequence[Drafter], prompt_ids: list[int], settings: DecodeSettings) -> None:
    """One short decode per method first, so one-off costs do not land in the first timing."""
    from dflash.eval.specdec import speculative_decode

    short = replace(settings, max_new_tokens=min(8, settings.max_new_tokens))
    for method in methods:
        speculative_decode(verifier, method, prompt_ids, short)


def evaluate_in_process(profile: Profile, run_dir: Path, checkpoint: Path, options: EvalOptions) -> EvalSummary:
    """The default (or `--prompts`) set into `eval/`, each of `eval.also_prompts` into `eval/<stem>/`, each
    benchmark (`--bench`, `eval.benchmarks`) into `eval/bench/<name>/`; the main report lists the extra
    sets' figures under `also_sets` (a benchmark's with its name)."""
    from dflash.eval.dflash2_drafter import load_draft
    from dflash.eval.mode import render_mode_for
    from dflash.eval.specdec import DecodeSettings

    main_path = eval_prompts_path(profile, options.prompts_path)
    also_paths = [path for path in also_prompt_paths(profile, options.prompts_path) if path.resolve() != main_path.resolve()]
    count = options.num_prompts or profile.eval.num_prompts
    benchmarks = load_benchmarks(profile, options)   # before the models: missing data ends it at once
    mode = render_mode_for(profile, checkpoint, options)    # so does a mode other than the training data's
    model, tokenizer, target_path = load_target(profile)
    draft = load_draft(str(checkpoint), model, profile.eval.draft_tokens)
    prepare_cpu_decoding(profile, model, draft)
    temperature = profile.eval.temperature if options.temperature is None else options.temperature
    seed = profile.eval.seed if options.seed is None else options.seed
    settings = DecodeSettings(block_size=draft.block_size, temperature=temperature,
                              max_new_tokens=options.max_new_tokens or profile.eval.max_new_tokens,
                              eos_ids=stop_token_ids(tokenizer, model))
    context = ReportContext(profile=profile.name, target=str(target_path), checkpoint=str(checkpoint), seed=seed,
                            max_new_tokens=settings.max_new_tokens, rendering=mode.describe(),
                            mode_mismatch=mode.mismatch)
    decode = _SetDecoder(profile, model, tokenizer, draft, settings, count, context, mode.thinking)
    eval_dir = run_dir / "eval"
    extra_files: list[Path] = []
    also_sets = []  # written before the main report, whose file marks the stage done
    for path in also_paths:
        extra = decode(path)
        extra_files += _write_set(extra, eval_dir / path.stem, None)
        also_sets.append(SetBrief.of(extra, eval_dir / path.stem / "report.json"))
    for name, samples in benchmarks.items():
        directory = eval_dir / "bench" / name
        extra = decode.benchmark(name, samples, benchmark_prompts_file(eval_dir, name, samples))
        extra_files += _write_set(extra, directory, None)
        also_sets.append(SetBrief.of(extra, directory / "report.json", benchmark=name))
    report = replace(decode(main_path), also_sets=also_sets)
    files = [*_write_set(report, eval_dir, run_dir / "train" / "metrics.jsonl"), *extra_files]
    return EvalSummary(report=report, files=files)


@dataclass
class _SetDecoder:
    """Decodes one prompt set with the target alone, the drafter and prompt lookup -> its report."""
    profile: Profile
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    draft: DFlashDraft
    settings: DecodeSettings
    num_prompts: int
    context: ReportContext
    thinking: bool                  # the prompts' mode (dflash.eval.mode)

    def __call__(self, prompts_path: Path) -> EvalReport:
        prompts = encode_prompts(self.tokenizer, prompts_path, self.num_prompts, self.thinking)
        results, threads = self._decode(prompts)
        return self._report(results, threads, prompts_path, prompt_set_label(prompts_path))

    def benchmark(self, name: str, samples: Sequence[BenchPrompt], prompts_path: Path) -> EvalReport:
        """A benchmark's samples: every first turn, then (mt-bench) every second turn after the first
        turn's answer (target-only greedy decoding's, which a lossless drafter's equals), in one report."""
        thinking = self.thinking
        first = [encode_messages(self.tokenizer, s.prompt_id, [_user(s.turns[0])], thinking) for s in samples]
        results, threads = self._decode(first)
        later = []
        for sample, runs in zip(samples, results):
            conversation = [_user(sample.turns[0])]
            answer = runs.runs[TARGET].tokens
            for number, turn in enumerate(sample.turns[1:], start=2):
                conversation += [{"role": "assistant", "content": str(self.tokenizer.decode(answer, skip_special_tokens=True))},
                                 _user(turn)]
                later.append(encode_messages(self.tokenizer, f"{sample.prompt_id}-turn{number}", list(conversation), thinking))
        if later:          # two turns at most (mt-bench): the second turns decode together, right after the first
            more, _ = self._decode(later, warm_up=False)
            results += more
        turns = "both turns" if later else "one turn"
        return self._report(results, threads, prompts_path,
                            f"benchmark {name} ({len(samples)} samples, {turns}; {prompts_path.name}: first turns)")

    def _decode(self, prompts: Sequence[EncodedPrompt], warm_up: bool = True) -> tuple[list[PromptRuns], int]:
        from dflash.eval.dflash2_drafter import with_unary
        from dflash.eval.prompt_lookup import PromptLookupDrafter

        lookup = PromptLookupDrafter(max_ngram=self.profile.eval.prompt_lookup_max_ngram)
        with cpu_threads(self.model, self.profile.eval.cpu_threads):
            threads = _torch_threads()
            results = decode_prompts(self.model, [*with_unary(self.draft), lookup], prompts, self.settings,
                                     self.context.seed or 0, self.draft.layer_ids, warm_up)
        return results, threads

    def _report(self, results: list[PromptRuns], threads: int, prompts_path: Path, label: str) -> EvalReport:
        from dflash.eval.dflash2_drafter import with_selector_figures
        from dflash.eval.report_writer import build_report

        context = replace(self.context, torch_threads=threads, prompts_file=str(prompts_path),
                          prompt_set=label, baseline=inprocess_baseline(self.profile, threads))
        report = build_report(results, block_size=self.settings.block_size, temperature=self.settings.temperature,
                              context=context)
        return with_selector_figures(report, self.draft, len(results))   # the last decoded prompts, no warm-up between


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def load_benchmarks(profile: Profile, options: EvalOptions) -> dict[str, list[BenchPrompt]]:
    """Each benchmark's first samples (z-lab's order; how many: `bench_sample_count`), by name; InputError
    when its data is missing."""
    from dflash.prompts.benchmarks import load_benchmark

    directory, count = bench_dir(profile, options), bench_sample_count(profile, options)
    return {name: load_benchmark(name, directory, count) for name in benchmark_names(profile, options)}


def inprocess_baseline(profile: Profile, threads: int) -> str:
    """How target-only decoding, the speedup's baseline, runs in-process (the drafting methods run the same way)."""
    from dflash.compat import transformers_version

    kernels = ("; linear layers on the faster CPU kernel per row count (eval.cpu_matmul auto)"
               if profile.eval.cpu_matmul == "auto" and profile.machine.device == "cpu" else "")
    return (f"target alone = this loop with no drafter: one cached forward a token (transformers "
            f"{transformers_version()} DynamicCache), {profile.model.dtype}, {threads} torch thread(s){kernels}; "
            f"as fast as transformers' generate on the same model and cache (benchmarks/bench_step_cost.py); "
            f"DFlash and prompt lookup run the same loop, model, cache, dtype and threads")


def _write_set(report: EvalReport, directory: Path, metrics_path: Optional[Path]) -> list[Path]:
    from dflash.eval.plots import write_plots
    from dflash.eval.report_writer import write_report

    return [*write_report(report, directory), *write_plots(report, directory, metrics_path)]


def manifest_figures(report: EvalReport) -> dict[str, object]:
    """What `status` shows for eval: tau and speedup of each drafting method (prefixed by the engine
    for an engine eval: `sglang_dflash_tau`)."""
    prefix = f"{report.engine}_" if report.engine else ""
    figures: dict[str, object] = {"prompts": report.num_prompts, "block_size": report.block_size}
    if report.context.mode_mismatch:
        figures[f"{prefix}mode_mismatch"] = True
    if report.context.prompt_set:
        figures[f"{prefix}prompt_set"] = report.context.prompt_set
    figures[f"{prefix}target_tokens_per_s"] = round(report.methods[TARGET].tokens_per_s, 2)
    for name, method in report.drafted().items():
        figures[f"{prefix}{name}_tau"] = _rounded(method.mean_tau, 3)
        figures[f"{prefix}{name}_speedup"] = _rounded(method.speedup or None, 3)
        if method.identical_to_target is not None:
            figures[f"{prefix}{name}_lossless"] = method.identical_to_target
    lift = report.selector_lift()
    if lift is not None:
        figures[f"{prefix}selector_lift"] = round(lift, 3)
    for extra in report.also_sets:
        stem = f"{prefix}bench_{extra.benchmark}" if extra.benchmark else Path(extra.prompts_file or extra.report).stem
        figures[f"{stem}_prompt_set"] = extra.prompt_set
        for name, brief in extra.methods.items():
            if name != TARGET and brief.mean_tau is not None:
                figures[f"{stem}_{name}_tau"] = round(brief.mean_tau, 3)
            if extra.benchmark and name != TARGET and brief.identical_to_target is not None:
                figures[f"{stem}_{name}_lossless"] = brief.identical_to_target
    return figures


def _rounded(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
