"""Every command-line option, and how a serving command's flags become an
:class:`~graphrunner_ref.engine.config.EngineConfig`.

:func:`parser` declares the commands (``demo``, ``generate``, ``serve``,
``sizes``, ``convert``) and their options, each in its help group (:class:`Groups`),
with its default, choices and bounds; :func:`demo_real_parser` declares
``make demo-real``'s. :func:`config_of` maps a parsed serving command to the
engine's one config: nothing past it reads a flag to decide how the engine
runs. The checks of each value (ranges, combinations, files) are
:mod:`graphrunner_ref.cli.checks`' and the other command modules'.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import graphrunner
from graphrunner.phases import MAX_STEPS_PER_LAUNCH
from graphrunner_ref.cli.common import MAX_STEPS
from graphrunner_ref.cli.groups import add_command
from graphrunner_ref.cli.prompts import FORMATS
from graphrunner_ref.cli.sizes import MAX_GRAPHS
from graphrunner_ref.engine.config import (
    DEFAULT_BATCHED_TOKENS,
    DTYPES,
    KV_DTYPES,
    MAX_BATCHED_TOKENS,
    EngineConfig,
)
from graphrunner_ref.engine.sampling import MAX_LOGPROBS
from graphrunner_ref.engine.spec_factory import DRAFTS, METHODS
from graphrunner_ref.io.aot_folder import AUTO, aot_folder
from graphrunner_ref.model.attention_backend import ATTENTIONS, LIVE_FROM_CAPACITY
from graphrunner_ref.model.parallel import SINGLE
from graphrunner_ref.model.quantize import QUANTIZATIONS

__all__ = [
    "DEFAULT_NEW_TOKENS",
    "MAX_DRAFT_TOKENS",
    "MODEL_IMPLS",
    "Groups",
    "config_of",
    "demo_real_parser",
    "parser",
]

#: ``--max-new-tokens`` by default: room for a chat answer (text stops at EOS).
DEFAULT_NEW_TOKENS = 128
#: Draft tokens per round at most (each one is a verify column).
MAX_DRAFT_TOKENS = 16
#: ``--model-impl`` choices.
MODEL_IMPLS = ("auto", "native", "transformers")

#: Where options are added: a parser, or one of its argument groups.
_Options = argparse._ActionsContainer


@dataclass(frozen=True, slots=True)
class Groups:
    """The help groups of a serving command."""

    model: _Options
    runner: _Options
    scheduling: _Options
    sampling: _Options
    prompts: _Options
    output: _Options

    @classmethod
    def of(
        cls,
        parser: argparse.ArgumentParser,
        prompts: tuple[str, str] = ("prompts", "what is asked, how much is answered"),
    ) -> Groups:
        """The groups on ``parser``, in help order; ``prompts``: the title and
        description of the group of what is served (the demo's is its trace)."""
        add = parser.add_argument_group
        return cls(
            model=add("model", "which model, its dtype, attention and context"),
            runner=add("runner and graphs", "how each step runs, what is captured and checked"),
            scheduling=add("scheduling", "how requests are batched and decoded"),
            sampling=add("sampling", "how tokens are picked (default: greedy)"),
            prompts=add(*prompts),
            output=add("output", "what is printed or written"),
        )


def parser() -> argparse.ArgumentParser:
    """The ``graphrunner`` command line: every command and option (each
    command's ``func`` is the caller's to set); ``parser.commands`` maps each
    command to its own parser."""
    top = argparse.ArgumentParser(
        prog="graphrunner",
        description="Capture LLM decode steps as graphs at fixed batch sizes and replay them "
        "padded: demo, generate, serve, sizes and convert. 'graphrunner COMMAND --help' shows a "
        "command's options and examples.",
    )
    top.add_argument("--version", action="version", version=f"%(prog)s {graphrunner.__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    _demo(add_command(sub, "demo"))
    _generate(add_command(sub, "generate"))
    _serve(add_command(sub, "serve"))
    _sizes(add_command(sub, "sizes"))
    _convert(add_command(sub, "convert"))
    top.commands = sub.choices  # type: ignore[attr-defined]
    return top


def _demo(demo: argparse.ArgumentParser) -> None:
    g = Groups.of(demo, ("trace", "the synthetic requests served"))
    _serving(g)
    g.prompts.add_argument(
        "--steps", type=int, default=300, help=f"decode steps to run, 1..{MAX_STEPS} (300)"
    )
    _run_outputs(g.output)


def _generate(gen: argparse.ArgumentParser) -> None:
    g = Groups.of(gen)
    _serving(g)
    gen.set_defaults(aot_cache=AUTO)
    _logprobs(
        g.output,
        f"write each token's log-probability and the top N (JSON lines), 0..{MAX_LOGPROBS} "
        "(0: none)",
    )
    _prompts(g.prompts)
    _answers(g.output)
    g.prompts.add_argument(
        "--max-new-tokens",
        "-n",
        "--max-tokens",
        dest="max_new_tokens",
        type=int,
        default=DEFAULT_NEW_TOKENS,
        help=f"1..the model's context ({DEFAULT_NEW_TOKENS}; a text answer stops earlier at "
        "the end-of-sequence token)",
    )
    g.scheduling.add_argument(
        "--arrive-every",
        type=int,
        default=0,
        metavar="K",
        help=f"prompt i arrives at engine step i*K, 0..{MAX_STEPS} (0: all at once)",
    )
    g.prompts.add_argument("--end-token", type=int, help="a token id that ends a request")
    g.runner.add_argument("--check", action="store_true", help="check each step against eager")
    _run_outputs(g.output)


def _logprobs(p: _Options, text: str) -> None:
    p.add_argument("--logprobs", type=int, default=0, metavar="N", help=text)


def _serve(serve: argparse.ArgumentParser) -> None:
    g = Groups.of(serve, ("server", "where it listens, who may ask, what waits"))
    serve.set_defaults(aot_cache=AUTO)
    g.model.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model takes it (default: embedded)",
    )
    _serving(g)
    _logprobs(
        g.output,
        f"collect each token's log-probability and the top N, 0..{MAX_LOGPROBS}, so that "
        "requests may ask for up to N (0: none may)",
    )
    g.prompts.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    g.prompts.add_argument(
        "--port", type=int, default=8000, help="port to listen on, 0..65535 (8000; 0: a free one)"
    )
    g.prompts.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients give (default: --model as given)",
    )
    g.prompts.add_argument(
        "--api-key",
        metavar="KEY",
        help="answer /v1 requests only with 'Authorization: Bearer KEY' (default: "
        "$GRAPHRUNNER_API_KEY; unset: no check)",
    )
    g.prompts.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        metavar="N",
        help="requests that may wait for their first token, 1..1000000 (256); one more is "
        "answered 503 with Retry-After",
    )
    g.prompts.add_argument(
        "--request-timeout",
        type=float,
        metavar="SECONDS",
        help="abort a request still running after this long (default: no deadline)",
    )
    g.prompts.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long requests in flight may take to finish before "
        "they are aborted (30)",
    )
    g.prompts.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the tokenizer's end-of-sequence token",
    )
    g.prompts.add_argument(
        "--end-token",
        type=int,
        help="a token id that ends an answer (default: the tokenizer's end-of-sequence token)",
    )
    g.output.add_argument(
        "--quiet", action="store_true", help="only errors on stderr (no startup lines, no log)"
    )


def _serving(g: Groups) -> None:
    """The options of every serving command, each in its help group."""
    _runner(g.runner)
    _model(g)
    g.runner.add_argument(
        "--tp",
        type=int,
        metavar="N",
        help="tensor-parallel ranks: the model sharded over N worker processes started "
        "here (gloo on the CPU, NCCL and one GPU a rank on CUDA), rank 0 printing; "
        "1..this machine's cores (CPU) or GPUs (1; under torchrun: its WORLD_SIZE). "
        "N > 1 not with --speculative, --overlap, --steps-per-launch > 1 or a Mamba/Jamba "
        "model; --tp 1 runs the collectives in a group of one process",
    )
    _sizes_and_checks(g)
    _sampling(g.sampling)
    g.model.add_argument(
        "--max-context-len",
        type=int,
        metavar="N",
        help="size request rows and the KV pool for N tokens, 1..the model's context "
        "(default: what the workload needs); a prompt plus its new tokens past N is refused",
    )
    _scheduling(g.scheduling)


def _runner(p: _Options) -> None:
    p.add_argument(
        "--device",
        help="cpu or cuda[:N] (default: the runner's: cuda for --runner cuda, cpu for "
        "--runner cpu or eager; with neither given, cuda when available, else cpu)",
    )
    p.add_argument(
        "--runner",
        choices=["cuda", "cpu", "eager"],
        help="default: the device's (cuda on a CUDA device, else cpu); eager runs on any device",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA runner only: run torch.compile'd programs (inductor, one per size) "
        "inside the CUDA graphs (the default for --runner cuda; --no-compile captures the "
        "eager forward)",
    )
    p.add_argument(
        "--aot-cache",
        metavar="DIR|none",
        help="CPU runner only: save the compiled step in DIR (an AOTInductor library) and "
        "load it at the next run without tracing the forward; a program saved for another "
        "model, size, dtype, torch or CPU is refused and rebuilt. generate and serve save "
        "by default in $GRAPHRUNNER_AOT_CACHE or <cache>/aot (~/.cache/graphrunner/aot), so "
        "only the first start compiles (a sampled step: its model, the sampler running after "
        "it); none: compile at every start",
    )


def _model(g: Groups) -> None:
    p = g.model
    p.add_argument(
        "--model",
        default="embedded",
        metavar="DIR|FILE.gguf|NAME",
        help="a Hugging Face-layout checkpoint directory, a .gguf file (converted once into "
        "the cache) or an embedded random model: embedded (the default: 2 layers, hidden 64) "
        "or embedded-1.1b (the shape of a 1.1B Llama: 22 layers, hidden 2048, context 1024)",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR|FILE.gguf",
        help="another name for --model PATH",
    )
    # gguf_file: the .gguf a checkpoint was converted from (set by the checks).
    p.set_defaults(checkpoint_flag="--checkpoint", gguf_file=None)
    p.add_argument(
        "--attention",
        choices=["auto", *ATTENTIONS],
        default="auto",
        help="decode attention of the model: auto (the Triton kernel on CUDA; on the CPU "
        "live with a float32 KV cache, otherwise live from --max-context-len "
        f"{LIVE_FROM_CAPACITY} up and torch below), torch (the "
        "reference everywhere: reads the whole --max-context-len of every row), live (CPU "
        "only: reads up to the batch's longest live row), triton (CUDA only) or "
        "triton-all-heads (CUDA only: the kernel's other split launch, one program over "
        "every KV head)",
    )
    p.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default="auto",
        help="native (the reference Llama), transformers (any transformers *ForCausalLM "
        "decoder through graphrunner's attention and pools) or auto (native where it "
        "supports the checkpoint, else transformers)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights, activations and KV cache (float32); logits are always float32",
    )
    p.add_argument(
        "--kv-dtype",
        choices=list(KV_DTYPES),
        default=None,
        help="the KV cache's dtype (default: --dtype's). float16 under --dtype float32, on "
        "the CPU: half the KV bytes a step reads (the C++ attention widens them exactly; "
        "each key and value rounded to float16 once, as llama.cpp's cache holds them); "
        "int8: each head vector of a token as int8 with a float32 scale, max|x|/127 "
        "(llama.cpp's q8_0 cache), about a quarter of float32's bytes",
    )
    p.add_argument(
        "--quantize",
        choices=list(QUANTIZATIONS),
        default=None,
        help="CPU: compact weights for every projection and the LM head (the native Llama, "
        "or any model's nn.Linear with --model-impl transformers), C++ AVX2 kernels built at "
        "first use. int8: int8 per output channel, activations in --dtype (half precision: "
        "torch's product, fast with AVX-512 or AMX); fp16: float16 weights, float32 "
        "activations and accumulation (--dtype float32; half the weight bytes); int4: 4-bit "
        "weights in groups of 32 columns with a scale and a min each, float32 activations "
        "(--dtype float32; a fifth of the weight bytes; a .gguf file's Q4 blocks as they are); "
        "int4-q8: int4's weights times activations quantized to 8 bits per group of 32, "
        "integer dots as llama.cpp's, but for the q/k/v projections' wider inputs (bfloat16 "
        "with AVX-512 BF16, else float32; the LM head's too without AVX-512 VNNI; opt-in, "
        "faster, answers leave float32's sooner; the "
        "kernel path, AVX2 or VNNI, from the CPU's features, said on stderr); int4-bf16: "
        "int4's weights and activations rounded to bfloat16, float32 sums (opt-in, for "
        "batches of 8 and more on CPUs with AVX-512 BF16; closer to float32 than int4-q8)",
    )
    p.add_argument(
        "--prefill-bf16",
        action="store_true",
        help="int4 modes, CPUs with AMX-BF16 or AVX-512 BF16: prompt chunks (32 rows and "
        "more) multiply the same weights widened to bfloat16 (oneDNN), decode steps the "
        "4-bit kernels; 2 more bytes a weight in memory, several times faster prefill",
    )


def _sizes_and_checks(g: Groups) -> None:
    p = g.runner
    p.add_argument(
        "--max-bs",
        type=int,
        help="largest captured batch size (default 16; generate: at most the number of prompts); "
        "refused past what the pools and graphs can take in the free memory",
    )
    p.add_argument(
        "--capture-sizes",
        help="comma-separated, e.g. 1,2,4,8 (default: graphrunner's policy up to --max-bs)",
    )
    g.sampling.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the embedded model's weights, of the demo's synthetic trace and of "
        "sampling (each request's seed derives from it and the request id unless a prompt "
        "gives its own; no effect on a --checkpoint's weights); 0..2**63-1 (default 0; "
        "generate with sampling draws a fresh one and prints it)",
    )
    p.add_argument(
        "--check-padding",
        action="store_true",
        help="run the padding sanitizer around every replay (debug mode, slower)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=1,
        help="KV page size in token slots, 1..the run's context (1: one slot per token)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads, 1..this machine's cores (1: the small models here gain "
        "nothing from more)",
    )


def _sampling(p: _Options) -> None:
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, >= 0 (0: greedy, the argmax token, the default)",
    )
    p.add_argument(
        "--top-k", type=int, default=0, help="keep the K most probable tokens, >= 0 (0: all)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="then the most probable tokens reaching probability P, in (0, 1] (1: all)",
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="then drop tokens below P times the most probable one's probability, in [0, 1]",
    )


def _scheduling(p: _Options) -> None:
    p.add_argument(
        "--speculative",
        choices=METHODS,
        help="chain speculative decoding with an EAGLE or a frozen-KV MTP draft head",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=2,
        metavar="K",
        help=f"draft tokens per round, 1..{MAX_DRAFT_TOKENS} (2); the verify runs K + 1",
    )
    p.add_argument(
        "--draft",
        choices=DRAFTS,
        default="random",
        help="random: a seeded random head built to fit the target (default); self: the "
        "target drafts for itself (every draft accepted); wrong: no draft ever accepted",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="overlap scheduling: prepare step N+1 on the host while step N runs "
        "(input tokens as future references resolved on the device); with "
        "--steps-per-launch N, launch i+1 while launch i runs",
    )
    p.add_argument(
        "--steps-per-launch",
        type=int,
        default=1,
        metavar="N",
        help=f"decode steps per graph launch, 1..{MAX_STEPS_PER_LAUNCH} (1); the tokens "
        "equal N = 1's; with --overlap, launch i+1 is prepared while launch i runs; not with "
        "--speculative or a Mamba/Jamba checkpoint",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help=f"tokens one engine step processes, 1..{MAX_BATCHED_TOKENS}: the running requests' "
        f"decode tokens first, then prompt chunks, so a long prompt is prefilled over several "
        f"steps and never stalls the running requests for its whole prefill (default "
        f"{DEFAULT_BATCHED_TOKENS} where the model's prefill extends a cached prefix; a "
        f"Mamba/Jamba checkpoint prefills each prompt whole and refuses this flag)",
    )
    p.add_argument(
        "--no-chunked-prefill",
        dest="chunked_prefill",
        action="store_false",
        help="prefill each admitted prompt whole in one step (not with --max-num-batched-tokens)",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt from its first token (default: a prompt's full pages "
        "already in the KV cache, from an earlier prompt or answer, are shared and not "
        "computed again; off by itself for a Mamba/Jamba checkpoint or --speculative eagle)",
    )
    p.add_argument(
        "--token-capture-sizes",
        metavar="N,N,...",
        help="token counts at which a step's prompt chunks are captured as one padded token "
        "batch, e.g. 16,64,256, the largest at least --max-num-batched-tokens (default: "
        "graphrunner's token sizes up to it); a step above the largest runs eagerly, counted",
    )


def _prompts(gen: _Options) -> None:
    gen.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help="file of prompts, one per line (-: stdin); see --prompts-format",
    )
    gen.add_argument(
        "--prompts-format",
        choices=FORMATS,
        default="auto",
        help="text: a text prompt per line; ids: a JSON list of token ids per line; jsonl: "
        'a JSON object per line, {"prompt": "text" or [ids], "max_new_tokens": N, '
        '"temperature": T, ...} (the way to give a prompt with newlines: "\\n" in its '
        "text); auto (default): [ lines are ids, { lines objects, others text, and a [ or { "
        "line that is not such JSON is text when the model has a tokenizer",
    )
    gen.add_argument(
        "--prompt",
        "-p",
        action="append",
        default=[],
        metavar="TEXT",
        help="a text prompt (repeatable; needs a checkpoint with a tokenizer)",
    )
    gen.add_argument(
        "prompt_text",
        nargs="*",
        metavar="PROMPT",
        help="text prompts, as --prompt (quote each one)",
    )
    gen.add_argument(
        "--chat", action="store_true", help="apply the checkpoint's chat template to text prompts"
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="finish an answer where its text reaches TEXT, left out of the answer "
        "(repeatable; needs the checkpoint's tokenizer)",
    )
    gen.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the tokenizer's end-of-sequence token",
    )


def _answers(gen: _Options) -> None:
    gen.add_argument(
        "--output",
        type=Path,
        metavar="FILE",
        help="write one JSON record per request here (JSON lines: prompt index, text, token "
        "ids, finish reason, token counts), instead of printing the answers",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print the JSON records instead of text (the default without a tokenizer)",
    )
    gen.add_argument(
        "--no-stream",
        action="store_true",
        help="print each text answer whole, not token by token as it is generated",
    )
    gen.add_argument(
        "--quiet", action="store_true", help="no progress bars and no summary line on stderr"
    )


def _run_outputs(p: _Options) -> None:
    """A serving run's outputs (``demo``, ``generate``) for ``graphrunner sizes``
    and for a profiler."""
    p.add_argument(
        "--batch-sizes-out",
        type=Path,
        metavar="FILE",
        help="write the runner's histogram of served batch sizes (for graphrunner sizes)",
    )
    p.add_argument(
        "--token-sizes-out",
        type=Path,
        metavar="FILE",
        help="write the token-batch runner's histogram of the prefill steps' token counts "
        "(for graphrunner sizes --tokens)",
    )
    p.add_argument(
        "--capture-report-out",
        type=Path,
        metavar="FILE",
        help="write the capture report (seconds and pool bytes per size) as JSON",
    )
    p.add_argument(
        "--trace-out",
        type=Path,
        metavar="FILE",
        help="write a torch profiler trace (Chrome / Perfetto JSON) of capture and serving, "
        "with graphrunner's capture, populate and replay ranges by name",
    )


def _sizes(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=Path,
        required=True,
        help="batch sizes served: a file of sizes, one per line, or a histogram written "
        "by demo --batch-sizes-out (runner.batch_sizes / EngineStats.histogram .write())",
    )
    p.add_argument(
        "--graphs", type=int, required=True, help=f"sizes to capture at most, 1..{MAX_GRAPHS}"
    )
    p.add_argument(
        "--max-bs",
        type=int,
        help="the largest size, always captured (default: the trace's largest; with "
        "--capture-report, the report's largest); larger batches run eagerly",
    )
    p.add_argument(
        "--memory-budget",
        type=int,
        metavar="BYTES",
        help="fit the graphs' pool bytes, per size as --capture-report recorded them",
    )
    p.add_argument(
        "--capture-report",
        type=Path,
        help="a capture report written by demo --capture-report-out (with --memory-budget)",
    )
    p.add_argument("--output", type=Path, help="write the list here, as --capture-sizes takes it")
    p.add_argument(
        "--tokens",
        action="store_true",
        help="the trace counts a token batch's tokens (demo --token-sizes-out): print the "
        "list as --token-capture-sizes",
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw the trace's histogram, the chosen sizes and the padding per size under "
        "them and under the default list (needs matplotlib: the plots extra)",
    )


def _convert(conv: argparse.ArgumentParser) -> None:
    conv.add_argument("--gguf", type=Path, required=True, help="the .gguf file to read")
    conv.add_argument(
        "--out", type=Path, required=True, help="directory to write (must not exist, or be empty)"
    )


def demo_real_parser(description: str | None, prompts: int) -> argparse.ArgumentParser:
    """``make demo-real``'s options (``prompts``: how many it has)."""
    p = argparse.ArgumentParser(
        prog="python -m graphrunner_ref.cli.demo_real", description=description
    )
    p.add_argument("--prompts", type=int, default=4, help=f"how many, 1..{prompts} (4)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="1..64 (24)")
    p.add_argument("--max-context-len", type=int, default=96, help="64..8192 (96)")
    p.add_argument("--runner", choices=["cuda", "cpu", "eager"], help="default: cuda on a GPU")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's own)")
    return p


def config_of(
    args: argparse.Namespace, runner: str = "cpu", sizes: Sequence[int] = ()
) -> EngineConfig:
    """The engine config of a parsed serving command: ``runner`` the resolved
    runner kind, ``sizes`` the capture sizes (empty until they are known).
    Read before the checks resolve every value too (the model kind is asked
    early), so a value still unresolved takes its default."""
    get = vars(args).get
    return EngineConfig(
        model=get("model"),
        checkpoint=get("checkpoint"),
        source="" if get("checkpoint") is None else f"{get('checkpoint_flag')} {get('checkpoint')}",
        gguf_file=get("gguf_file"),
        model_impl=get("model_impl", "auto"),
        dtype=get("dtype", "float32"),
        kv_dtype=get("kv_dtype"),
        quantize=get("quantize"),
        prefill_bf16=get("prefill_bf16", False),
        attention=get("attention", "auto"),
        max_context_len=get("max_context_len"),
        seed=get("seed") or 0,
        runner=runner,
        device=str(get("device") or "cpu"),
        compile=bool(get("compile")),
        aot_cache=aot_folder(get("aot_cache")),
        capture_sizes=tuple(sizes),
        page_size=get("page_size", 1),
        tp=get("tp"),
        placement=get("tensor_parallel") or SINGLE,
        threads=get("threads"),
        check_padding=get("check_padding", False),
        check=get("check", False),
        speculative=get("speculative"),
        draft=get("draft", "random"),
        draft_tokens=get("draft_tokens", 2),
        overlap=get("overlap", False),
        steps_per_launch=get("steps_per_launch", 1),
        chunked_prefill=get("chunked_prefill", True),
        prefix_caching=get("prefix_caching", True),
        max_num_batched_tokens=get("max_num_batched_tokens"),
        token_capture_sizes=tuple(get("token_sizes") or ()),
        logprobs=get("logprobs", 0),
        max_steps=get("steps"),
        quiet=get("quiet", False),
    )
