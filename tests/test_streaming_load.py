"""The shipped checkpoint names, their validation, and the streaming loader: one tensor at a time, drafters reading
only `mtp.*`, and each tensor-parallel rank reading only its slice."""
import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import dspark
from dspark.distributed.sharding import load_target_shard, shard_drafter, shard_model, tp_drafter
from dspark.model import checkpoint as ck_mod
from dspark.model.checkpoint import CheckpointError, CheckpointReader, meta_target, read_tensors, stream_state


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    "A tiny checkpoint in the release format (FP8 blocks + packed FP4 experts) with an MTP layer."
    return dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), drafter="mtp", fmt="fp8")


def test_written_fp8_names_are_the_shipped_ones(fp8_ckpt):
    keys = set(json.loads((fp8_ckpt / "model.safetensors.index.json").read_text())["weight_map"])
    assert not any(k.endswith(".weight.scale") for k in keys)
    for k in ("layers.0.attn.wq_a", "layers.3.ffn.experts.7.w2", "layers.2.attn.indexer.wq_b",
              "layers.1.ffn.shared_experts.w1", "mtp.0.e_proj", "mtp.0.attn.wo_b"):
        assert k + ".weight" in keys and k + ".scale" in keys, k
    raw = read_tensors(fp8_ckpt)
    assert raw["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.3.ffn.experts.7.w2.weight"].dtype == torch.int8
    assert raw["layers.3.ffn.experts.7.w2.scale"].dtype == torch.float8_e8m0fnu
    assert all(k.endswith(".weight") or k.endswith(".scale") or v.dtype not in (torch.float8_e4m3fn, torch.int8)
               for k, v in raw.items())


@pytest.mark.parametrize("fmt", ["float32", "fp8"])
def test_matches_transformers(fmt, tiny_ckpt, fp8_ckpt):
    "transformers 5.17 reads the shipped layout itself (renaming `X.scale`): our reference load agrees with it."
    transformers = pytest.importorskip("transformers")
    if fmt == "fp8": pytest.importorskip("accelerate")      # transformers' FP8 loader needs it (it dequantises on CPU)
    ck = tiny_ckpt if fmt == "float32" else fp8_ckpt
    ours = dspark.load_target(ck, quantization="none")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ck, dtype=torch.float32).float().eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 40))
    with torch.no_grad(): theirs = hf(ids).logits.float()
    assert (ours.logits(ids) - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def _rewrite(src, dst, fn):
    "A copy of checkpoint `src` as one shard, its tensors changed by `fn(raw)`."
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    raw = read_tensors(src)
    fn(raw)
    save_file({k: v.contiguous() for k, v in raw.items()}, dst / "model.safetensors")
    return dst


def _rename(raw, a, b): raw[b] = raw.pop(a)

W, S = "layers.1.attn.wkv.weight", "layers.1.attn.wkv.scale"
E, ES = "layers.4.ffn.experts.2.w1.weight", "layers.4.ffn.experts.2.w1.scale"

@pytest.mark.parametrize("damage,expect,names", [
    (lambda r: _rename(r, S, W + ".scale"), "old-style", [W + ".scale"]),
    (lambda r: r.pop(S), "without a", [W]),
    (lambda r: r.pop(ES), "without a", [E]),
    (lambda r: r.__setitem__(S, r[S][:, :1].contiguous()), "mis-shaped scales", [S]),
    (lambda r: r.__setitem__(ES, r[ES][:, 1:].contiguous()), "mis-shaped scales", [ES]),
    (lambda r: r.__setitem__(S, r[S].float()), "float8_e8m0fnu", [S]),
    (lambda r: r.__setitem__("layers.0.attn_norm.scale", torch.ones(1, dtype=torch.float8_e8m0fnu)), "orphan", ["layers.0.attn_norm.scale"]),
])
def test_malformed_quantisation_is_refused(fp8_ckpt, tmp_path, damage, expect, names):
    bad = _rewrite(fp8_ckpt, tmp_path / "bad", damage)
    with pytest.raises(CheckpointError, match=expect) as e:
        dspark.load_target(bad)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_uint8_scales_are_read_as_e8m0(fp8_ckpt, tmp_path):
    "The documented choice: E8M0 scales stored as raw uint8 bytes load like float8_e8m0fnu ones."
    def to_u8(r):
        for k in [k for k in r if k.endswith(".scale")]: r[k] = r[k].view(torch.uint8)
    alt = _rewrite(fp8_ckpt, tmp_path / "u8", to_u8)
    a, b = dspark.load_target(fp8_ckpt), dspark.load_target(alt)
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()): assert torch.equal(x, y), k


def test_reader_holds_one_tensor_at_a_time(fp8_ckpt):
    cfg = dspark.load_config(fp8_ckpt)
    r = CheckpointReader(fp8_ckpt)
    model = stream_state(meta_target(cfg), r, "t", scope=[k for k in r.keys() if not k.startswith("mtp.")])
    ref = dspark.load_target(fp8_ckpt)
    for (k, x), y in zip(ref.state_dict().items(), model.state_dict().values()): assert torch.equal(x, y), k
    target_keys = [k for k in r.keys() if not k.startswith("mtp.")]
    sizes = {k: torch.Size(r.shape(k)).numel() * r.dtype(k).itemsize for k in target_keys}
    assert r.tensors_read == len(target_keys) and r.bytes_read == sum(sizes.values())
    assert r.peak_live <= 2                                 # a weight and its scale
    assert r.peak_live_bytes <= 2 * max(sizes.values()) < sum(sizes.values()) / 10
    everything = [r.get(k) for k in target_keys]            # the counter does see a loader that hoards
    assert r.peak_live >= len(everything)


def test_model_tensors_of_a_stored_dtype_get_the_stored_bytes(fp8_ckpt):
    "A model that keeps FP8 (weight + scale) and packed FP4 as stored is filled without conversion, by the same loop."
    from torch import nn
    r = CheckpointReader(fp8_ckpt)
    keys = ["layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "layers.4.ffn.experts.2.w1.weight",
            "layers.4.ffn.experts.2.w1.scale", "layers.0.attn_norm.weight"]
    m = nn.Module()
    for k in keys:
        owner, _, leaf = k.rpartition(".")
        parent = m
        for part in owner.split("."):
            if not hasattr(parent, part): parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        dtype = r.dtype(k) if r.dtype(k) != torch.bfloat16 else torch.float32
        parent.register_parameter(leaf, nn.Parameter(torch.empty(r.shape(k), dtype=dtype, device="meta"), requires_grad=False))
    stream_state(m, r, "as stored", scope=keys)
    raw, got = read_tensors(fp8_ckpt), m.state_dict()
    for k in keys:
        want = raw[k].float() if raw[k].dtype == torch.bfloat16 else raw[k]
        assert got[k].dtype == want.dtype and torch.equal(got[k].view(torch.uint8) if got[k].element_size() == 1 else got[k],
                                                          want.view(torch.uint8) if want.element_size() == 1 else want), k


class _Spy(CheckpointReader):
    "The shipped reader, remembering every instance so that a test can read its byte counter."
    made: list = []
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw); _Spy.made.append(self)


def test_mtp_loader_reads_only_mtp(fp8_ckpt, monkeypatch):
    from dspark.model.mtp import load_mtp
    target = dspark.load_target(fp8_ckpt)
    monkeypatch.setattr(ck_mod, "CheckpointReader", _Spy); _Spy.made.clear()
    m = load_mtp(fp8_ckpt, target)
    (r,) = _Spy.made
    mtp = [k for k in r.keys() if k.startswith("mtp.")]
    assert r.bytes_read == sum(torch.Size(r.shape(k)).numel() * r.dtype(k).itemsize for k in mtp)
    assert m.state_dict()["mtp.0.e_proj.weight"].dtype == torch.float32


@pytest.mark.parametrize("fmt,q", [("float32", "none"), ("fp8", "none"), ("fp8", "auto")])
def test_tp_shards_equal_sharded_full_model(fmt, q, tiny_ckpt, fp8_ckpt, monkeypatch):
    """Each rank's streamed slices equal `shard_model` / `shard_drafter` applied to the whole model (FP8 splits
    inside 128-blocks too), for the target and its drafter (DSpark stages in the fp32 checkpoint, MTP in the fp8 one),
    dequantised or kept as stored (the same bytes: FP8 codes with the scale blocks that cover them)."""
    from dspark.model.drafter import load_drafter
    from dspark.model.mtp import load_mtp
    ck = tiny_ckpt if fmt == "float32" else fp8_ckpt
    load_d = load_drafter if fmt == "float32" else load_mtp
    full = dspark.load_target(ck, quantization=q)
    full_d = load_d(ck, full, quantization=q)
    monkeypatch.setattr(ck_mod, "CheckpointReader", _Spy)
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t
    for rank in range(2):
        want = copy.deepcopy(full); shard_model(want, rank, 2)
        got = load_target_shard(ck, rank, 2, quantization=q)
        want_d = copy.deepcopy(full_d); shard_drafter(want_d, rank, 2)
        _Spy.made.clear()
        got_d = load_d(ck, got, shard=tp_drafter(rank, 2, full.cfg.n_routed_experts), quantization=q)
        for a, b in ((want.state_dict(), got.state_dict()), (want_d.state_dict(), got_d.state_dict())):
            assert list(a) == list(b)
            for k in a: assert a[k].dtype == b[k].dtype and torch.equal(raw(a[k]), raw(b[k])), (rank, k)
        (r,) = _Spy.made
        mtp = sum(torch.Size(r.shape(k)).numel() * r.dtype(k).itemsize for k in r.keys() if k.startswith("mtp."))
        assert r.bytes_read < 0.75 * mtp


def test_progress_bar_only_when_asked_or_on_a_terminal(tiny_ckpt, capsys):
    dspark.load_target(tiny_ckpt, progress=True)
    assert "loading" in capsys.readouterr().err
    dspark.load_target(tiny_ckpt)                      # stderr is not a terminal under pytest
    dspark.load_target(tiny_ckpt, progress=False)
    assert capsys.readouterr().err == ""


def _tp_rank(rank, world, ck, port, out):
    import torch.distributed as dist
    from dspark.distributed import sharding
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    made = []
    class Spy(CheckpointReader):
        def __init__(self, *a, **kw): super().__init__(*a, **kw); made.append(self)
    sharding.CheckpointReader = Spy
    model = load_target_shard(ck, rank, world)
    torch.manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40))
    torch.save({"bytes": made[0].bytes_read, "logits": model.logits(ids), "ids": ids}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_tp2_ranks_read_half_and_match(tiny_ckpt, tmp_path):
    import re
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.start_processes(_tp_rank, args=(2, str(tiny_ckpt), port, str(tmp_path)), nprocs=2, start_method="spawn")
    r = CheckpointReader(tiny_ckpt)
    size = lambda k: torch.Size(r.shape(k)).numel() * r.dtype(k).itemsize
    keys = [k for k in r.keys() if not k.startswith("mtp.")]
    split = re.compile(r"^(embed|head)\.weight$|attn\.(wq_b|wo_a|wo_b)\.weight$|attn_sink$|indexer\.(wq_b|weights_proj)\.weight$"
                       r"|shared_experts\.w[123]\.weight$|\.experts\.\d+\.")
    halved = sum(size(k) for k in keys if split.search(k))
    replicated = sum(size(k) for k in keys if not split.search(k))
    full = dspark.load_target(tiny_ckpt)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["bytes"] == replicated + halved // 2, (rank, got["bytes"], replicated, halved)
        want = full.logits(got["ids"])
        assert (got["logits"] - want).abs().max() <= 1e-5 * want.abs().max()


def test_tp2_ranks_read_their_stored_slices(fp8_ckpt, monkeypatch):
    """Kept as stored, each rank reads half of every split weight (FP8 codes), the scale blocks covering its half,
    its half of the routed experts (packed FP4 + scales), and every replicated tensor; no value is dequantised."""
    import re
    from dspark.distributed import sharding
    from dspark.model.weights import FP8Linear
    made = []
    class Spy(CheckpointReader):
        def __init__(self, *a, **kw): super().__init__(*a, **kw); made.append(self)
    monkeypatch.setattr(sharding, "CheckpointReader", Spy)
    r = CheckpointReader(fp8_ckpt)
    size = lambda k: torch.Size(r.shape(k)).numel() * r.dtype(k).itemsize
    keys = [k for k in r.keys() if not k.startswith("mtp.")]
    split = re.compile(r"^(embed|head)\.weight$|attn\.(wq_b|wo_a|wo_b)\.weight$|attn_sink$|indexer\.(wq_b|weights_proj)\.weight$"
                       r"|shared_experts\.w[123]\.weight$|\.experts\.\d+\.")
    scales = re.compile(r"attn\.(wq_b|wo_a|wo_b)\.scale$|indexer\.wq_b\.scale$|shared_experts\.w[123]\.scale$")
    halved = sum(size(k) for k in keys if split.search(k))
    replicated = sum(size(k) for k in keys if not split.search(k) and not scales.search(k))
    covering = sum(size(k) for k in keys if scales.search(k))      # at most all of a split weight's scale blocks
    for rank in range(2):
        model = load_target_shard(fp8_ckpt, rank, 2, quantization="auto")
        assert isinstance(model.layers[2].attn.indexer.wq_b, FP8Linear)
        got = made[-1].bytes_read
        assert replicated + halved // 2 + covering // 2 <= got <= replicated + halved // 2 + covering, (rank, got)


def test_stored_split_inside_a_block_is_refused(fp8_ckpt):
    "A width whose split cuts a 128-block of FP8 scales is refused, naming the tensor (it splits fine dequantised)."
    cfg = ck_mod.load_config(fp8_ckpt, {"moe_intermediate_size": 384})      # 192 per rank: rank 1 starts mid-block
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.shared_experts\.w1\.weight: 2 ranks split its output width "
                                         r"384 into slices of 192, and rank 1's starts at 192"):
        shard_model(meta_target(cfg, quantization="auto"), 0, 2)
    shard_model(meta_target(cfg, quantization="none"), 0, 2)


def test_quantization_argument(tiny_ckpt):
    import importlib.util
    with pytest.raises(ValueError, match="quantization"):
        dspark.load_target(tiny_ckpt, quantization="fp8")
    if importlib.util.find_spec("dspark.model.weights") is None:     # the as-stored weight objects are not built in
        with pytest.raises(ValueError, match="quantization='auto' needs dspark.model.weights"):
            dspark.load_target(tiny_ckpt, quantization="auto")


def test_direct_reads_equal_safetensors_reads(fp8_ckpt):
    "The `pread` path gives the same bytes as safetensors' own reader: whole tensors, row slices and column slices."
    fast, ref = CheckpointReader(fp8_ckpt), CheckpointReader(fp8_ckpt, direct=False)
    for k in fast.keys():
        a, b = fast.get(k), ref.get(k)
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b), k
        if a.dim() == 2 and a.shape[0] > 2 and a.shape[1] > 2:
            for sl in ((0, 1, a.shape[0] - 1), (1, 1, a.shape[1] - 1)):
                x, y = fast.get(k, sl), ref.get(k, sl)
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (k, sl)
    assert fast.bytes_read == ref.bytes_read


def test_truncated_shard_is_refused_at_open(fp8_ckpt, tmp_path):
    d = tmp_path / "cut"; shutil.copytree(fp8_ckpt, d)
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointReader(d)
