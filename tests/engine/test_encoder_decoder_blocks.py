"""Cross-attention blocks of encoder-decoder requests: taken once per request at admission, shared by reference
with every parallel sample and read by every slot of a beam search (never copied), and all given back after finish,
abort and preemption. Bad encoder-decoder input is refused with the field named."""
from __future__ import annotations

import pytest

from fasterllm import LLM, BeamSearchParams, SamplingParams
from fasterllm.engine.input_processor import InputProcessor
from fasterllm.errors import InvalidInputError

pytest.importorskip("transformers")

ENCODER_IDS = list(range(3, 23))  # 20 tokens: three cross blocks of 8
BLOCKS = 64


@pytest.fixture(scope="module")
def llm(tiny_seq2seq):
    return LLM(str(tiny_seq2seq["bart"][0]), dtype="float32", device="cpu", num_kv_blocks=BLOCKS, block_size=8)


def step_until(engine, condition, limit: int = 50) -> list:
    outputs = []
    for _ in range(limit):
        if condition():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError("condition not reached")


def test_cross_blocks_are_taken_once_and_freed_at_finish(llm):
    engine, kv = llm.engine, llm.engine.kv_cache
    engine.add_request("one", ENCODER_IDS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    cross = kv.cross_tables["one"]
    assert len(cross) == 3 and all(kv.ref_counts[b] == 1 for b in cross)
    assert not set(cross) & set(kv.block_table("one"))
    engine.step()
    assert kv.cross_tables["one"] == cross  # not taken again as the decoder goes on
    step_until(engine, lambda: not engine.has_unfinished_requests())
    assert kv.num_free_blocks == BLOCKS and not kv.cross_tables


def test_beams_share_the_cross_blocks_by_reference(llm):
    engine, kv = llm.engine, llm.engine.kv_cache
    engine.add_request("search", ENCODER_IDS, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    engine.step()
    cross = kv.cross_tables["search"]
    copies = []
    move_blocks = engine.executor.runner.move_blocks
    engine.executor.runner.move_blocks = lambda message: copies.extend(message.copies) or move_blocks(message)
    try:
        engine.step()  # now all four slots compute
    finally:
        engine.executor.runner.move_blocks = move_blocks
    search = engine.requests["search"].group
    assert len({table[-1] for table in search.blocks.tables}) == 4
    assert kv.cross_tables["search"] == cross and all(kv.ref_counts[b] == 1 for b in cross)  # held once
    assert engine.executor.runner.requests.searches["search"].cross_block_table == cross  # read by every slot's row
    assert copies and not {block for pair in copies for block in pair} & set(cross)  # never copied
    assert not set(cross) & set().union(*search.blocks.tables)
    step_until(engine, lambda: not engine.has_unfinished_requests())
    assert kv.num_free_blocks == BLOCKS and not kv.cross_tables


def test_parallel_samples_share_the_cross_blocks(llm):
    engine, kv = llm.engine, llm.engine.kv_cache
    engine.add_request("n3", ENCODER_IDS, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1))
    engine.step()
    cross = kv.cross_tables["n3"]
    assert all(kv.ref_counts[b] == 3 for b in cross)
    outputs = step_until(engine, lambda: not engine.has_unfinished_requests())
    assert len(outputs[-1].outputs) == 3
    assert kv.num_free_blocks == BLOCKS


def test_abort_gives_every_block_back(llm):
    engine, kv = llm.engine, llm.engine.kv_cache
    engine.add_request("gone", ENCODER_IDS, BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("gone")
    assert kv.num_free_blocks == BLOCKS and not kv.cross_tables and not engine.has_unfinished_requests()


def test_preemption_frees_cross_blocks_and_the_encoder_runs_again(tiny_seq2seq):
    llm = LLM(str(tiny_seq2seq["bart"][0]), dtype="float32", device="cpu", num_kv_blocks=10, block_size=8,
              watermark=0, preemption_mode="swap")  # swap is asked for; encoder-decoder requests recompute
    engine, kv = llm.engine, llm.engine.kv_cache
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for index in range(2):
        engine.add_request(f"p{index}", ENCODER_IDS, params)
    outputs = step_until(engine, lambda: engine.scheduler.stats.num_preemptions > 0)
    preempted = [r for r in engine.scheduler.waiting]
    assert preempted and all(r.request_id not in kv.cross_tables for r in preempted)
    assert engine.scheduler.stats.num_swapped_out == 0
    outputs += step_until(engine, lambda: not engine.has_unfinished_requests(), limit=200)
    finished = {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
    assert finished["p0"] == finished["p1"]  # the same input gives the same tokens, preempted or not
    assert kv.num_free_blocks == 10


def test_bad_encoder_decoder_input_names_the_field(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidInputError, match="encoder takes at most 64") as info:
        engine.add_request("long", list(range(3, 60)) * 2, params)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidInputError, match="needs an 'encoder_prompt'"):
        engine.add_request("no-encoder", {"decoder_prompt": [5, 6]}, params)
    with pytest.raises(InvalidInputError, match="encoder prompt token ids"):
        engine.add_request("bad-ids", [5, 99], params)
    with pytest.raises(ValueError, match="encoder-decoder model"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert not engine.has_unfinished_requests()


def test_a_decoder_only_model_refuses_an_encoder_prompt():
    inputs = InputProcessor(tokenizer=None, vocab_size=64, max_model_len=32)  # no seq2seq config: decoder-only
    with pytest.raises(InvalidInputError, match="encoder_prompt / decoder_prompt are for encoder-decoder models"):
        inputs.generation_inputs({"encoder_prompt": [5, 6]})


def test_an_architecture_we_do_not_run_is_named_before_its_fields_are_read(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["PegasusForConditionalGeneration"], "d_model": 8}')
    with pytest.raises(ValueError, match="'PegasusForConditionalGeneration' is not supported; supported: .*BartFor"):
        LLM(str(tmp_path), device="cpu")


def test_searches_wider_together_than_max_num_seqs_take_turns(tiny_seq2seq):
    """Four searches of width 4 under max_num_seqs=8: admission counts a search's slots, so no step
    runs more than 8 sequences (the worker's buffers hold that many), and the hypotheses are unchanged."""
    directory = str(tiny_seq2seq["bart"][0])
    prompts = [ENCODER_IDS, ENCODER_IDS[:7], ENCODER_IDS[5:], ENCODER_IDS[::2]]
    params = BeamSearchParams(beam_width=4, max_tokens=6)
    roomy = LLM(directory, dtype="float32", device="cpu", num_kv_blocks=BLOCKS, block_size=8)
    tight = LLM(directory, dtype="float32", device="cpu", num_kv_blocks=BLOCKS, block_size=8, max_num_seqs=8)
    sizes = []
    execute = tight.engine.executor.runner.execute
    tight.engine.executor.runner.execute = lambda message: sizes.append(
        len(message.request_ids) + sum(message.searches.num_slots)) or execute(message)  # a search: a row per slot
    expected = roomy.beam_search(prompts, params, use_tqdm=False)
    got = tight.beam_search(prompts, params, use_tqdm=False)
    assert [[s.token_ids for s in o.sequences] for o in got] == [[s.token_ids for s in o.sequences] for o in expected]
    assert max(sizes) == 8
    with pytest.raises(ValueError, match="beam_width=16 is more than max_num_seqs=8"):
        tight.beam_search(prompts, BeamSearchParams(beam_width=16, max_tokens=4), use_tqdm=False)
