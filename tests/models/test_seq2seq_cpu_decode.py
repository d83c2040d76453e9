"""A BART-family decode step through every decoder layer in one C++ call (models/seq2seq_cpu_decode.py): the layers'
own operators chained in C++, so each family (BART, Marian, mBART, M2M100: post- and pre-norm, GELU, SiLU, ReLU),
fp32 and bf16, float and int8, must choose the same tokens with the same logprobs as the Python layers, to the bit,
in a batch that shrinks as requests finish and in beam search (whose slots share their cross blocks); a model or a
step the stack does not run keeps the Python layers."""
from __future__ import annotations

import pytest
import torch

from fasterllm import LLM, BeamSearchParams, SamplingParams
from fasterllm.models.registry import supported_models
from fasterllm.models import seq2seq_cpu_decode
from fasterllm.models.seq2seq_cpu_decode import Seq2SeqDecodeStack
from decode_stacks import CountingStack
from seq2seq_models import VOCAB, randomize_seq2seq_, tiny_seq2seq_config

pytest.importorskip("transformers")

EOS = 2
INPUTS = [[5, 9, 11, 3, 7, EOS], list(range(3, 40)) + [EOS], [17, 23, 29, 31, EOS]]  # the second past 2 blocks
MAX_TOKENS = [14, 6, 10]  # three rows, then two, then one


class RecordingStack(CountingStack):
    """The model's stack, counting its steps and recording the attention its self- and cross-attention took (1: the
    C++ decode attention, 0: SDPA)."""

    def __init__(self, stack: Seq2SeqDecodeStack, monkeypatch):
        super().__init__(stack)
        self.chosen, self.native = [], set()
        group = seq2seq_cpu_decode._group

        def recording(decode, native_attention):
            tensors, ints = group(decode, native_attention)
            self.chosen.append(ints[5])
            return tensors, ints

        monkeypatch.setattr(seq2seq_cpu_decode, "_group", recording)

    def __call__(self, *args):
        out = super().__call__(*args)
        self.native |= {("self", self.chosen[-2]), ("cross", self.chosen[-1])}  # the call reads self's group first
        return out


def _make_llm(directory, **overrides) -> LLM:
    settings = dict(dtype="float32", device="cpu", num_kv_blocks=96, block_size=8, enable_prefix_caching=False)
    settings.update(overrides)
    return LLM(str(directory), **settings)


def _generate_and_search(llm: LLM):
    """Greedy tokens and 3 logprobs per step of three requests at once, then beam-4 hypotheses and scores of two."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    greedy = [(o.outputs[0].token_ids, [{t: e[t].logprob for t in e} for e in o.outputs[0].logprobs])
              for o in llm.generate(INPUTS, params, use_tqdm=False)]
    beams = llm.beam_search(INPUTS[:2], BeamSearchParams(beam_width=4, max_tokens=8), use_tqdm=False)
    return greedy, [[(s.token_ids, s.cumulative_logprob) for s in out.sequences] for out in beams]


def _with_and_without_stack(llm: LLM, monkeypatch):
    model = llm.engine.executor.runner.model
    assert model.cpu_decode_stack is not None
    counting = RecordingStack(model.cpu_decode_stack, monkeypatch)
    monkeypatch.setattr(model, "cpu_decode_stack", counting)
    ours = _generate_and_search(llm)
    monkeypatch.setattr(model, "cpu_decode_stack", None)
    return ours, _generate_and_search(llm), counting


@pytest.mark.parametrize("family", ["bart", "marian", "mbart", "m2m_100"])
def test_each_family_decodes_as_its_layers(tiny_seq2seq, family, cpu_kernels_on, monkeypatch):
    directory, _ = tiny_seq2seq[family]
    llm = _make_llm(directory)
    row = next(row for row in supported_models() if row["architecture"] == llm.engine.model_config.architecture)
    assert row["cpu_decode_step"] == "one C++ call"  # what `fasterllm models` says
    ours, layers, counting = _with_and_without_stack(llm, monkeypatch)
    assert ours == layers
    assert counting.calls >= max(MAX_TOKENS) + 8 - 1  # greedy's steps (each a decode) and most of the searches'
    assert counting.native == {("self", 0), ("cross", 0)}  # heads the C++ attention does not take: SDPA
    greedy, beams = ours
    assert [len(tokens) for tokens, _ in greedy] == MAX_TOKENS
    assert len({tuple(tokens) for tokens, _ in greedy}) == 3  # the inputs matter
    assert all(len(hypotheses) == 4 for hypotheses in beams)


@pytest.fixture(scope="module")
def bart_64_dim_heads(tmp_path_factory):
    """A tiny BART whose heads are 64 wide: a size the C++ decode attention runs."""
    import transformers as T

    from parity.parity_utils import save_tiny_tokenizer

    config = tiny_seq2seq_config("bart")
    config.d_model, config.encoder_attention_heads, config.decoder_attention_heads = 128, 2, 2
    torch.manual_seed(0)
    model = T.AutoModelForSeq2SeqLM.from_config(config, dtype=torch.float32)
    randomize_seq2seq_(model, 3)
    directory = tmp_path_factory.mktemp("bart_64") / "bart"
    model.save_pretrained(directory, safe_serialization=True)
    save_tiny_tokenizer(directory, VOCAB)
    return directory


@pytest.mark.parametrize("dtype, quantization, native", [
    ("bfloat16", None, {("self", 1), ("cross", 1)}),  # the C++ attention for both, bf16 or fp32
    ("float32", None, {("self", 1), ("cross", 1)}),
    ("float32", "int8", {("self", 1), ("cross", 1)}),
    ("bfloat16", "int4", {("self", 1), ("cross", 1)}),
])
def test_the_cpp_attention_and_quantized_products_as_the_layers_run_them(bart_64_dim_heads, cpu_kernels_on,
                                                                         monkeypatch, dtype, quantization, native):
    llm = _make_llm(bart_64_dim_heads, dtype=dtype, quantization=quantization)
    if quantization:  # linears.h's kInt8, or kInt4 (kInt4Int8Inputs where FASTERLLM_CPU_INT4_INPUTS asks)
        kind = llm.engine.executor.runner.model.cpu_decode_stack.kinds[0]
        assert kind in ((0,) if quantization == "int8" else (1, 2))
    ours, layers, counting = _with_and_without_stack(llm, monkeypatch)
    assert ours == layers
    assert counting.calls > 0 and counting.native == native


def test_models_and_steps_it_does_not_run(tiny_seq2seq, bart_64_dim_heads, cpu_kernels_on, monkeypatch):
    # T5 (relative position biases on the scores) has no stack; a step with a prompt in it runs the layers
    t5 = _make_llm(tiny_seq2seq["t5"][0])
    assert getattr(t5.engine.executor.runner.model, "cpu_decode_stack", None) is None
    row = next(row for row in supported_models() if row["architecture"] == t5.engine.model_config.architecture)
    assert row["cpu_decode_step"] == "Python layers"
    llm = _make_llm(bart_64_dim_heads)
    model = llm.engine.executor.runner.model
    counting = CountingStack(model.cpu_decode_stack)
    monkeypatch.setattr(model, "cpu_decode_stack", counting)
    prompt = {"encoder_prompt": INPUTS[0], "decoder_prompt": [12, 30, 7]}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert counting.calls == 0  # one step, whose decoder prompt is four tokens
    # without our C++ kernels (FASTERLLM_CPU_KERNELS=off) there is no stack
    monkeypatch.setenv("FASTERLLM_CPU_KERNELS", "off")
    from fasterllm.kernels.native import cpu_extension

    cpu_extension.kernel_isa.cache_clear()
    assert Seq2SeqDecodeStack.of(model) is None
