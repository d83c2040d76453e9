"""The `fasterllm` command: generate, chat, serve, bench, bench serve."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import sys
from pathlib import Path

from fasterllm.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineArgs
from fasterllm.sampling_params import SamplingParams, StructuredOutputsParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory, .gguf file or cached hub id (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory, if not the model's")
    g.add_argument("--dtype", default=defaults.dtype, help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default=defaults.device, help="auto, cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=defaults.block_size)
    g.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    g.add_argument("--cpu-kv-cache-gib", type=float, default=defaults.cpu_kv_cache_gib)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--seed", type=int, default=defaults.seed)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=defaults.enable_prefix_caching, help="reuse the KV of shared prompt prefixes")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=defaults.preemption_mode)
    g.add_argument("--swap-space-gib", type=float, default=defaults.swap_space_gib,
                   help="CPU pool for preemption by swap")
    g.add_argument("--long-prefill-token-threshold", type=int, default=defaults.long_prefill_token_threshold,
                   help="most prompt tokens one request takes per step (0 = no cap)")
    g.add_argument("--max-prefill-tokens-beside-decodes", type=int, default=defaults.max_prefill_tokens_beside_decodes,
                   help="most prompt tokens a step that carries decodes takes: bounds the time between a stream's "
                        "tokens while prompts arrive (0 = only max-num-batched-tokens)")
    g.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs (decode steps, encoder batches)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next decode step before reading this one's tokens (default: on with CUDA)")
    g.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="quantized at load: int8 / int4 weight-only, w8a8 (INT8 weights and activations), fp8 (Hopper "
                        "GPUs); gguf: a GGUF's Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 blocks as stored (README: Quantization)")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=defaults.kv_cache_dtype,
                   help="auto: the model's dtype (fp8 for a checkpoint with KV-cache scales); fp8 (= fp8_e4m3): e4m3 "
                        "K/V with the checkpoint's scales (else 1.0), half the bytes of bf16 per token")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=defaults.tensor_parallel_size,
                   help="shard the model over this many GPUs (one process each)")
    g.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"], default=None,
                   help="uni: one rank in this process; mp: one process per rank on this machine; ray: a Ray actor "
                        "per rank across the nodes of a Ray cluster (default: uni for one rank, mp for more)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=defaults.data_parallel_size,
                   help="serve: this many engine processes, each a copy of the model on its own "
                        "tensor-parallel-size GPUs, requests balanced by load")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="tensor parallelism on GPUs: NCCL for every all-reduce (default: decode steps sum over "
                        "symmetric memory, fused with the norm after, where the GPUs allow it)")
    g.add_argument("--load-format", choices=["auto", "dummy"], default=defaults.load_format,
                   help="dummy: random weights of the model's shape (config.json is enough; for benchmarks)")


def engine_args_from(ns: argparse.Namespace, **overrides) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    values.update(overrides)
    return EngineArgs(**values)


def add_sampling_args(parser: argparse.ArgumentParser, temperature: float) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    constraint = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the answer is JSON following the schema in FILE")
    constraint.add_argument("--regex", help="the answer matches this regular expression")
    constraint.add_argument("--choice", action="append", help="the answer is one of these strings (repeatable)")


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                          seed=ns.sampling_seed, max_tokens=ns.max_tokens, stop=ns.stop, ignore_eos=ns.ignore_eos,
                          min_tokens=ns.min_tokens, repetition_penalty=ns.repetition_penalty,
                          presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
                          structured_outputs=structured_outputs_from(ns))


def structured_outputs_from(ns: argparse.Namespace) -> StructuredOutputsParams | None:
    if ns.json_schema is not None:
        return StructuredOutputsParams(json=Path(ns.json_schema).read_text())  # a missing file: FileNotFoundError
    if ns.regex is not None or ns.choice is not None:
        return StructuredOutputsParams(regex=ns.regex, choice=ns.choice)
    return None


def cmd_generate(ns: argparse.Namespace) -> None:
    from fasterllm.llm import LLM

    params = sampling_params_from(ns)
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    # an instruct model's chat template wraps the prompt; an encoder-decoder model takes the text itself
    use_template = (not ns.no_chat_template and llm.get_tokenizer().chat_template is not None
                    and not llm.engine.model_config.is_encoder_decoder)
    if use_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], params)
    else:
        outputs = llm.generate(ns.prompts, params)
    for prompt, output in zip(ns.prompts, outputs):
        if len(ns.prompts) > 1:
            print(f"### {prompt}")
        print(output.outputs[0].text)


def cmd_chat(ns: argparse.Namespace) -> None:
    from fasterllm.engine.engine import Engine

    engine = Engine(engine_args_from(ns))
    params = sampling_params_from(ns)
    history: list[dict[str, str]] = [{"role": "system", "content": ns.system}] if ns.system else []
    print("Chatting with", engine.model_name, "- empty line or Ctrl-D to quit.", file=sys.stderr)
    for turn in itertools.count():
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        engine.add_request(f"chat-{turn}", engine.tokenizer.encode_chat(history), params)
        shown = ""
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                print(text[len(shown):], end="", flush=True)
                shown = text
        print()
        history.append({"role": "assistant", "content": shown})


def cmd_models(ns: argparse.Namespace) -> None:
    from fasterllm.models.registry import supported_models

    rows = supported_models()
    columns = list(rows[0])
    widths = [max(len(c), *(len(r[c]) for r in rows)) for c in columns]
    for values in [dict(zip(columns, columns)), *rows]:
        print("  ".join(values[c].ljust(w) for c, w in zip(columns, widths)).rstrip())


def cmd_bench(ns: argparse.Namespace) -> None:
    from fasterllm.bench.offline import run_offline_bench

    run_offline_bench(engine_args_from(ns), ns.num_prompts, ns.input_len, ns.output_len, not ns.no_hf, ns.repeats,
                      ns.shared_prefix_len, ns.long_prompt_len, ns.input_len_max, ns.beam_width or ns.n,
                      bool(ns.beam_width), ns.sharegpt_like, ns.final_only)


def cmd_serve(ns: argparse.Namespace) -> None:
    from fasterllm.entrypoints.openai.server import ServeOptions, run_server

    run_server(engine_args_from(ns, model=ns.model_path or ns.model),
               ServeOptions(ns.host, ns.port, ns.api_key, ns.served_model_name, ns.shutdown_timeout,
                            ns.embedding_model, ns.embedding_quantization, ns.api_server_count))


def cmd_bench_serve(ns: argparse.Namespace) -> None:
    from fasterllm.bench.serve import run_serve_bench

    run_serve_bench(ns.base_url, ns.endpoint, ns.num_prompts, ns.input_len, ns.output_len, ns.max_concurrency,
                    ns.request_rate, ns.api_key, ns.served_model_name, ns.seed, ns.sharegpt_like, ns.client_processes)


def cmd_embed(ns: argparse.Namespace) -> None:
    import json

    from fasterllm.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns, task="embed")))
    for output in llm.embed(ns.texts, truncate_prompt_tokens=ns.truncate_prompt_tokens, use_tqdm=False):
        print(json.dumps(output.outputs.embedding))


def cmd_bench_embed(ns: argparse.Namespace) -> None:
    from fasterllm.bench.embed import run_embed_bench

    run_embed_bench(engine_args_from(ns, task="embed"), ns.num_sentences, ns.min_words, ns.max_words, ns.repeats,
                    not ns.no_hf, ns.hf_batch_size, ns.seed, ns.threads, ns.random_encoder)


def add_embed_parsers(sub) -> None:
    embed = sub.add_parser("embed", help="one embedding per text, printed as a JSON list per line")
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--truncate-prompt-tokens", type=int, default=None,
                       help="keep the last N tokens of a longer text (-1: the model's limit); default: refuse it")
    add_engine_args(embed)
    embed.set_defaults(func=cmd_embed)

    bench = sub.add_parser("bench-embed", help="embedding throughput on mixed-length sentences, next to transformers")
    bench.add_argument("--num-sentences", type=int, default=64)
    bench.add_argument("--min-words", type=int, default=3)
    bench.add_argument("--max-words", type=int, default=120)
    bench.add_argument("--hf-batch-size", type=int, default=32, help="sentences per padded transformers batch")
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers runs")
    bench.add_argument("--repeats", type=int, default=5, help="interleaved runs of each; the median is reported")
    bench.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    bench.add_argument("--random-encoder", choices=["minilm-l6", "bert-base", "bert-large"], default=None,
                       help="a BERT of this shape with random bf16 weights and a made-up vocabulary, instead of --model")
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench_embed)


def add_serve_parsers(sub, bench: argparse.ArgumentParser) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, embeddings, metrics)")
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="model to serve (same as --model; default: embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="requests under /v1 must send 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    serve.add_argument("--embedding-model", default=None, metavar="PATH|default",
                       help="also serve /v1/embeddings with this model: an encoder directory, or a LLaMA-family "
                            "decoder (.gguf or directory; last-token pooling) ('default': the embedded "
                            "all-MiniLM-L6-v2); off unless given")
    serve.add_argument("--embedding-quantization", choices=QUANTIZATION_METHODS, default=None,
                       help="quantize the --embedding-model at load (a LLaMA-family decoder only; encoders run "
                            "unquantized); --quantization is the generate model's")
    serve.add_argument("--api-server-count", "-asc", type=int, default=1,
                       help="HTTP server processes in front of the one engine process: each streams its own "
                            "clients' tokens, so many concurrent streams do not wait on one process (default 1)")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    online = bench.add_subparsers(dest="bench_mode").add_parser(
        "serve", help="online benchmark against a running `fasterllm serve` (streaming requests)")
    online.add_argument("--base-url", default="http://127.0.0.1:8000")
    online.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    online.add_argument("--num-prompts", type=int, default=64)
    online.add_argument("--input-len", type=int, default=128, help="prompt tokens (completions: exact; chat: about)")
    online.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    online.add_argument("--max-concurrency", type=int, default=16, help="most requests in flight at once")
    online.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals per second (inf: all at once, bounded by --max-concurrency)")
    online.add_argument("--api-key", default=None)
    online.add_argument("--served-model-name", default=None, help="default: the server's only model")
    online.add_argument("--seed", type=int, default=0,
                        help="draws the prompts (and --sharegpt-like lengths); give each run against one server a "
                             "seed of its own, or the server's prefix cache holds the prompts of the run before")
    online.add_argument("--sharegpt-like", action="store_true",
                        help="workload (e): each request's prompt and output lengths drawn from a ShareGPT-shaped "
                             "distribution (as `fasterllm bench --sharegpt-like` draws its first run's)")
    online.add_argument("--client-processes", type=int, default=None,
                        help="processes the clients are spread over (default: one per 32 clients, at most half "
                             "the CPUs)")
    online.set_defaults(func=cmd_bench_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fasterllm", description="LLM inference with a paged KV cache")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up and progress")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="send the prompt as raw text (by default an instruct model's chat template wraps it)")
    add_engine_args(gen)
    add_sampling_args(gen, temperature=0.0)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming the reply")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    models = sub.add_parser("models", help="every architecture fasterllm runs, and what it runs with")
    models.set_defaults(func=cmd_models)
    bench = sub.add_parser("bench", help="offline throughput/latency benchmark, next to transformers")
    bench.add_argument("--num-prompts", type=int, default=32)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--n", type=int, default=1, help="sampled sequences per prompt (temperature 1)")
    bench.add_argument("--beam-width", type=int, default=0, help="beam search of this width instead of sampling")
    bench.add_argument("--input-len-max", type=int, default=None,
                       help="prompt lengths uniform in [input-len, input-len-max] (default: all input-len)")
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--sharegpt-like", action="store_true",
                       help="each request's prompt and output lengths from a fixed ShareGPT-like distribution "
                            "(workload (e); ignores --input-len, --output-len; needs --no-hf)")
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved runs of each; the median is reported")
    bench.add_argument("--shared-prefix-len", type=int, default=0,
                       help="every prompt starts with the same random prefix of this many tokens")
    bench.add_argument("--long-prompt-len", type=int, default=0,
                       help="one prompt of this many tokens arrives once the others are decoding (ITL under load)")
    bench.add_argument("--final-only", action="store_true",
                       help="each request yields only its final output, as LLM.generate (and vLLM's throughput "
                            "benchmark) asks: no output is built each step; no ITL figures")
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)
    add_serve_parsers(sub, bench)
    add_embed_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        ns.func(ns)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
