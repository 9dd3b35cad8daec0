"""`python -m dspark.bench`'s harness on the CPU at a toy size: the steady-load client (`--waves`) keeps exactly the
requested number of requests in flight and serves them all, and the command line refuses nonsense."""
import pytest

import dspark
from dspark.tools.bench import timed_batch, format_table, parse_args, run_bench
from dspark.sample.sampling import SamplingParams


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("bench"), preset="tiny", seed=0, drafter="dspark")


@pytest.mark.parametrize("spec", [None, "dspark"])
def test_steady_load_keeps_c_in_flight(ck, spec):
    llm = dspark.LLM(ck, speculative=spec, device="cpu", max_num_seqs=8, kv_cache_memory_bytes=32 * 2**20)
    in_flight, step = [], llm.step
    def watched():
        in_flight.append(len(llm.scheduler.running) + len(llm.scheduler.waiting))
        return step()
    llm.step = watched
    prompts = [[2 + i, 3 + i, 4 + i, 5] for i in range(7)]
    sps = [SamplingParams(temperature=0.0, max_tokens=3 + i % 3, ignore_eos=True) for i in range(7)]
    _, _, outs = timed_batch(llm, prompts, sps, False, "cpu", concurrency=3)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3 + i % 3 for i in range(7)]
    assert max(in_flight) == 3 and in_flight[0] == 3          # never more than 3, and 3 from the start
    ref = llm.generate(prompts, sps, use_tqdm=False)           # the same tokens as a closed batch
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_run_bench_waves(ck):
    rec = run_bench(ck, modes=("dspark",), concurrencies=(2,), max_tokens=4, prompt_len=8, device="cpu",
                    dtype="float32", backend="reference", kv_bytes=32 * 2**20, waves=3)
    r = rec["decode"][0]
    assert rec["waves"] == 3 and (r["concurrency"], r["requests"], r["tokens"]) == (2, 6, 24)
    assert "3 waves of C requests" in format_table(rec)


def test_cli_refuses_bad_values():
    for argv in (["--waves", "0"], ["--concurrency", "0"], ["--max-tokens", "0"], ["--temperature", "-1"]):
        with pytest.raises(SystemExit): parse_args(argv)
    assert parse_args(["--waves", "4", "--device", "cpu"]).waves == 4


def test_prefill_lengths_fit_the_model_before_anything_runs(capsys):
    """The embedded model's context is 2,048 tokens: by default the prefill sweep keeps the 1K prompt and says which
    it skipped; a length asked for that does not fit stops the run at once, not after the decode sweep."""
    from dspark.tools.bench import main, prefill_lengths
    from dspark.model.checkpoint import DEFAULT_MODEL
    assert prefill_lengths(DEFAULT_MODEL, None) == [1024]
    assert "[4096, 16384, 65536] skipped" in capsys.readouterr().err
    assert prefill_lengths(DEFAULT_MODEL, []) == [] and prefill_lengths(DEFAULT_MODEL, [2040]) == [2040]
    for asked in ([4096], [2041], [0]):
        with pytest.raises(SystemExit, match="--prefill"): prefill_lengths(DEFAULT_MODEL, asked)
    with pytest.raises(SystemExit, match=r"--prefill \[4096\]"):
        main(["--model", "dspark", "--device", "cpu", "--prefill", "4096", "--concurrency", "1"])
