"""Grammar engines for structured output, measured on our tokenizer (issue 25 asks to measure two or more and
pick one): time to compile a nested JSON schema (cold, then from the engine's cache), and time per token to
fill the next-token bitmask and advance the matcher along a JSON document the schema accepts.

    PYTHONPATH=<dir with llguidance and xgrammar> python benchmarks/grammar_engines.py [--model PATH]

Uses the default SmolLM2 tokenizer (49,152 tokens) unless --model names another.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "country": {"type": "string", "enum": ["FR", "DE", "IT", "ES", "UK"]}},
            "required": ["street", "city", "country"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "address", "active"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "notes"],
            "address": {"street": "12 St James's Square", "city": "London", "country": "UK"}, "score": 0.97,
            "active": True}


def hf_tokenizer(model: str | None):
    from transformers import PreTrainedTokenizerFast

    from fasterllm.loader.checkpoint import open_checkpoint

    wrapper = open_checkpoint(model, None).tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=wrapper.tokenizer, eos_token=wrapper.decode(
        [wrapper.eos_token_ids[0]], skip_special_tokens=False))


def run_llguidance(tok, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    start = time.perf_counter()
    info = llguidance.hf.from_tokenizer(tok)
    setup = time.perf_counter() - start
    compiles = []
    for _ in range(2):
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        matcher = llguidance.LLMatcher(info, grammar)
        compiles.append(time.perf_counter() - start)
    bitmask = llguidance.numpy.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for token in tokens:
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = bool(bitmask[0, token // 32] >> (token % 32) & 1)
        matcher.consume_token(token)
        steps.append(time.perf_counter() - start)
        assert allowed, f"llguidance refused token {token}"
    return {"tokenizer_setup_s": setup, "compile_first_s": compiles[0], "compile_again_s": compiles[1], "steps": steps,
            "accepted": matcher.is_accepting()}


def run_xgrammar(tok, tokens: list[int]) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgrammar.GrammarCompiler(info)
    setup = time.perf_counter() - start
    compiles = []
    for _ in range(2):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        compiles.append(time.perf_counter() - start)
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        allowed = bool(int(bitmask[0, token // 32]) >> (token % 32) & 1)
        matcher.accept_token(token)
        steps.append(time.perf_counter() - start)
        assert allowed, f"xgrammar refused token {token}"
    return {"tokenizer_setup_s": setup, "compile_first_s": compiles[0], "compile_again_s": compiles[1], "steps": steps,
            "accepted": matcher.is_terminated() or matcher.accept_token(tok.eos_token_id)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    tok = hf_tokenizer(args.model)
    tokens = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    print(f"tokenizer: {len(tok)} tokens; document: {len(tokens)} tokens")
    for name, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            result = run(tok, tokens)
        except Exception as exc:  # a missing package or an API change: say so, measure the others
            print(f"{name:10s}: failed: {type(exc).__name__}: {exc}")
            continue
        steps = sorted(result["steps"])
        print(json.dumps({"engine": name, "tokenizer_setup_ms": round(1e3 * result["tokenizer_setup_s"], 1),
                          "compile_first_ms": round(1e3 * result["compile_first_s"], 2),
                          "compile_again_ms": round(1e3 * result["compile_again_s"], 2),
                          "mask_and_advance_us_median": round(1e6 * statistics.median(steps), 1),
                          "mask_and_advance_us_p99": round(1e6 * steps[int(0.99 * (len(steps) - 1))], 1),
                          "document_accepted": bool(result["accepted"])}))


if __name__ == "__main__":
    main()
