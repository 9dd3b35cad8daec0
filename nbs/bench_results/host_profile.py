"""Host time of C1 decoding (H200, bf16, graphs): cProfile over 256 greedy tokens on the default model (no-spec and
DSpark) and 128 on the medium preset, after a warm-up; the functions with the most own time. OUT=. python host_profile.py"""
import cProfile, io, json, os, pstats, tempfile, time, torch, dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
OUT = os.environ["OUT"]; res = {"gpu": torch.cuda.get_device_name()}
prompt = sweep_prompts(DEFAULT_MODEL, 1, 128)[0]
medium = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
for name, path, mode, n in (("default_none", DEFAULT_MODEL, None, 256), ("default_dspark", DEFAULT_MODEL, "dspark", 256),
                            ("medium_none", medium, None, 128)):
    llm = dspark.LLM(path, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                     kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    p = prompt if path == DEFAULT_MODEL else list(range(5, 133))
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([p], sp, use_tqdm=False)
    torch.cuda.synchronize(); t0 = time.perf_counter(); llm.generate([p], sp, use_tqdm=False); torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    prof = cProfile.Profile(); prof.enable(); llm.generate([p], sp, use_tqdm=False); torch.cuda.synchronize(); prof.disable()
    s = io.StringIO(); st = pstats.Stats(prof, stream=s); st.sort_stats("tottime").print_stats(45)
    st2 = io.StringIO(); pstats.Stats(prof, stream=st2).sort_stats("cumulative").print_stats(45)
    res[name] = {"wall_s": wall, "tok_s": n / wall, "steps": llm.graphs.replays, "tottime": s.getvalue(), "cumulative": st2.getvalue()}
    print(name, round(n / wall, 1), "tok/s", flush=True); print(s.getvalue()[:6000], flush=True)
    del llm; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/host_profile.json", "w"), indent=1)
