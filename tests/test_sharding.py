"""Weights sharded by FSDP2 across two gloo ranks give the single-process results."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import headlab
from headlab.errors import UserError
from headlab.parallel import distributed, memory, sharding
from headlab.runs.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
N_BLOCKS = 5


@contextlib.contextmanager
def _group(backend: str, rank: int, world: int, store: str):
    """This process as ``rank`` of a ``world``-rank group on a file store; after it, the
    group is destroyed and headlab's data parallelism (which sharding turns off) is back."""
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        distributed.set_data_parallel(True)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_llama_shards(tmp_path_factory, bpe_tokenizer):
    """A random Llama (2 layers, E=64, GQA 4/2 heads) saved by transformers in several
    safetensors files with their model.safetensors.index.json."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(bpe_tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=bpe_tokenizer.eos_token_id, eos_token_id=bpe_tokenizer.eos_token_id)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama-shards")
    model.save_pretrained(path, max_shard_size="100KB")
    bpe_tokenizer.save_pretrained(path)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def _scored(model) -> dict:
    blocks = headlab.make_blocks(headlab.load_texts(), model.tokenizer, kind=model.kind,
                                 seq_len=32, max_tokens=32 * 2 * N_BLOCKS)
    blocks = blocks.subset(list(range(N_BLOCKS)))
    scores = headlab.score(model, blocks, method="michel", batch_size=2, normalize=False)
    ablation = headlab.score(model, blocks, method="ablation", batch_size=2)
    plan = headlab.select(scores, 4)
    return {"scores": scores.scores, "ablation": ablation.scores,
            "loss": headlab.evaluate(model, blocks, batch_size=2).loss,
            "kept": {str(k): v for k, v in plan.kept.items()}, "plan": plan}


def _worker(rank: int, model_dir: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    with _group("gloo", rank, 2, store):
        model, reads = sharding.load_sharded(model_dir)
        assert sharding.is_sharded(model) and not distributed.data_parallel()
        result = _scored(model)
        sharding.save_sharded(model, Path(out) / "pruned", result.pop("plan"))
        result["reads"] = {"tensors": reads.tensors, "elements": reads.elements,
                           "sliced": reads.sliced}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def _close(a, b, rel=1e-5):
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64),
                               torch.tensor(b, dtype=torch.float64), rtol=rel, atol=1e-9,
                               equal_nan=True)


@pytest.mark.slow
def test_two_sharded_ranks_equal_one_process(tiny_llama_shards, tmp_path):
    one = headlab.load(tiny_llama_shards)
    params = {id(p): p.numel() for p in one.parameters()}
    single = _scored(one)
    pruned_one = headlab.prune(one, single.pop("plan"))
    mp.spawn(_worker, args=(str(tiny_llama_shards), str(tmp_path / "store"), str(tmp_path)),
             nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for multi in ranks:  # every rank holds the whole data's result
        _close(multi["scores"], single["scores"])
        _close(multi["ablation"], single["ablation"])
        _close(multi["loss"], single["loss"])
        assert multi["kept"] == single["kept"]
    # each rank read its own rows of every parameter, the two together each element once
    total = sum(params.values())
    assert [r["reads"]["tensors"] for r in ranks] == [len(params)] * 2
    assert all(r["reads"]["sliced"] for r in ranks)
    assert sum(r["reads"]["elements"] for r in ranks) == total
    assert all(0.4 * total < r["reads"]["elements"] < 0.6 * total for r in ranks)
    # the saved model is the single-process pruned model, tensor for tensor
    saved = headlab.load(tmp_path / "pruned")
    assert saved.head_ids() == pruned_one.head_ids()
    mine, theirs = saved.state_dict(), pruned_one.state_dict()
    assert mine.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=0, atol=0)


def _launches(command: list[str], tmp_path: Path, *, out: bool = True) -> dict[str, str]:
    """``headlab command`` run by one process and by torchrun on two ranks with
    --shard fsdp (into tmp_path/one and tmp_path/two with ``out``); their stdout."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun comes with torch; the venv should have it"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    runs = {"one": [sys.executable, "-m", "headlab"],
            "two": [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "headlab"]}
    printed = {}
    for name, launch in runs.items():
        extra = ["--shard", "fsdp"] if name == "two" else []
        where = ["--out", str(tmp_path / name)] if out else []
        done = subprocess.run([*launch, *command, *extra, *where], env=env,
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        printed[name] = done.stdout
    return printed


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "lsq", "distill"])
def test_torchrun_cli_sharded_prune_like_one_process(tiny_gpt2_dir, tmp_path, method):
    """GPT-2's fused c_attn is read whole and then sharded; scores, kept heads, quality
    and the saved model (repaired by lsq: W_O, the MLP's down projection and their
    biases, all sharded; or lsq then a few steps of distillation of every parameter)
    are those of one process."""
    few = ["--recover-params", "all", "--recover-tokens", "128"] if method == "distill" else []
    _launches(["prune", "--model", str(tiny_gpt2_dir), "--keep", "0.5", "--schedule",
               "one-shot", "--recover", method, *few, "--max-tokens", "640", "--seq-len",
               "32", "--batch-size", "2", "-q"], tmp_path)
    a, b = (json.loads((tmp_path / n / "results.json").read_text()) for n in ("one", "two"))
    _close(b["importance"], a["importance"])
    assert b["kept_heads"] == a["kept_heads"]
    _close(b["quality"]["after"], a["quality"]["after"])
    assert (b["recovery"] is None) == (method == "none")
    if method != "none":
        _close(b["quality"]["pruned"], a["quality"]["pruned"])
        _close([e["error_after"] for e in b["recovery"]["layers"]],
               [e["error_after"] for e in a["recovery"]["layers"]])
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if p.is_dir()) == ["model"]
    assert (tmp_path / "two" / "model" / "model.safetensors.index.json").is_file()
    one, two = (headlab.load(tmp_path / n / "model").state_dict() for n in ("one", "two"))
    assert one.keys() == two.keys()
    exact = method == "none"
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0 if exact else 1e-5,
                                   atol=0 if exact else 1e-6)


@pytest.mark.slow
def test_torchrun_cli_sharded_detect_like_one_process(tiny_llama_shards, tmp_path):
    printed = _launches(["detect", "--model", str(tiny_llama_shards), "--examples", "4",
                         "--seq-len", "32", "--json"], tmp_path, out=False)
    one, two = (json.loads(printed[n]) for n in ("one", "two"))  # rank 0 alone printed
    assert one.keys() == two.keys() and len(one) > 3
    from headlab.importance import HeadScores

    for kind in one:
        _close(HeadScores.from_json(two[kind]).scores, HeadScores.from_json(one[kind]).scores)


def _meta_llama(tie: bool):
    from headlab.models.llama import Llama, LlamaConfig

    with sharding.meta_parameters():
        return Llama(LlamaConfig.from_hf(dict(
            vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)))


def test_units_leave_tied_weights_with_the_root():
    untied, tied = _meta_llama(False), _meta_llama(True)
    assert [type(u).__name__ for u in memory.units(untied)][4:] == [
        "Embedding", "RMSNorm", "Linear"]
    assert [type(u).__name__ for u in memory.units(tied)][4:] == ["RMSNorm"]
    # what the root keeps, gathered for the whole forward: the tied embedding, once
    est = memory.estimate(tied, ranks=2, batch_size=1, seq_len=8, backward=False,
                          dtype=torch.float32)
    block = sum(p.numel() for p in tied.blocks[0].parameters())
    assert est.gathered == 4 * (1000 * 64 + 2 * block)
    total = sum(p.numel() for p in tied.parameters())
    assert est.parameters == 4 * total // 2


def test_a_prune_counts_the_pruned_model_beside_the_one_it_came_from():
    """A sharded prune holds two models' shards per rank: the guard refuses a prune that
    would not fit, where scoring the same model fits."""
    model = _meta_llama(False)
    kw = dict(ranks=2, batch_size=1, seq_len=128, backward=True, dtype=torch.bfloat16)
    one, two = memory.estimate(model, **kw), memory.estimate(model, models=2, **kw)
    assert two.parameters == 2 * one.parameters
    assert (two.gathered, two.activations) == (one.gathered, one.activations)
    memory.check_memory(model, device="cpu", limit=one.total, **kw)
    with pytest.raises(UserError, match="^not enough memory"):
        memory.check_memory(model, device="cpu", limit=one.total, models=2, **kw)


def test_memory_guard_refuses_in_one_line_naming_what_fits():
    model = _meta_llama(False)

    def need(ranks, batch):
        return memory.estimate(model, ranks=ranks, batch_size=batch, seq_len=128,
                               backward=True, dtype=torch.bfloat16).total

    kw = dict(seq_len=128, backward=True, dtype=torch.bfloat16, device="cpu")
    fits = memory.check_memory(model, ranks=2, batch_size=3, limit=need(2, 3), **kw)
    assert fits.total == need(2, 3)
    with pytest.raises(UserError) as err:
        memory.check_memory(model, ranks=2, batch_size=8, limit=need(2, 3), **kw)
    msg = str(err.value)
    assert "\n" not in msg and "--batch-size 3 would fit" in msg
    assert need(2, 4) > need(2, 3)
    # parameters dominate at batch 1: more ranks fit where one does not
    limit = need(3, 1)
    with pytest.raises(UserError, match=r"\b3 ranks \(torchrun --nproc_per_node 3"):
        memory.check_memory(model, ranks=1, batch_size=1, limit=limit, **kw)
    assert need(2, 1) > limit


def test_a_sharded_prune_repairs_once_and_distils_without_lora():
    for method in ("none", "bias", "lsq", "rescale", "distill"):
        assert RunConfig(model="m", keep=0.5, shard="fsdp", recover=method).validated()
    for params in ("out", "attention", "all"):
        assert RunConfig(model="m", keep=0.5, shard="fsdp", recover="distill",
                         recover_params=params).validated()
    with pytest.raises(UserError, match=r"^--recover-params lora does not run with --shard "
                                        r"fsdp .*: use --recover-params out, attention or all$"):
        RunConfig(model="m", keep=0.5, shard="fsdp", recover="distill",
                  recover_params="lora").validated()
    with pytest.raises(UserError, match="drop --recover-every-step"):
        RunConfig(model="m", keep=0.5, shard="fsdp", recover="lsq",
                  recover_every_step=True).validated()


def _gpu_worker(rank: int, world: int, store: str, out: str) -> None:
    """bf16 sharded michel scores of SmolLM2-135M on ``world`` GPUs (nccl)."""
    torch.cuda.set_device(rank)
    with _group("nccl", rank, world, store):
        model, _ = sharding.load_sharded("smollm2-135m", device=f"cuda:{rank}",
                                         dtype=torch.bfloat16)
        blocks = headlab.make_blocks(headlab.load_texts(), model.tokenizer, kind=model.kind,
                                     seq_len=256, max_tokens=8192)
        torch.cuda.reset_peak_memory_stats()
        scores = headlab.score(model, blocks, method="michel", batch_size=8).scores
        est = memory.estimate(model, ranks=world, batch_size=8, seq_len=256, backward=True,
                              dtype=torch.bfloat16)
        if rank == 0:
            Path(out).write_text(json.dumps({
                "scores": scores, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "estimate_gib": est.total / 2**30}))


@pytest.mark.gpu
@pytest.mark.real
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_sharded_scores_rank_heads_like_float32(tmp_path):
    """On every GPU present (one rank alone where there is one GPU: nccl will not put two
    ranks on one device), bf16 sharded scoring ranks the heads as float32 does."""
    from scipy.stats import spearmanr

    ref = headlab.load("smollm2-135m", device="cuda", dtype=torch.float32)
    blocks = headlab.make_blocks(headlab.load_texts(), ref.tokenizer, kind=ref.kind,
                                 seq_len=256, max_tokens=8192)
    s32 = headlab.score(ref, blocks, method="michel", batch_size=8).tensor().flatten()
    del ref
    world = torch.cuda.device_count()
    out = tmp_path / "bf16.json"
    mp.spawn(_gpu_worker, args=(world, str(tmp_path / "store"), str(out)), nprocs=world,
             join=True)
    got = json.loads(out.read_text())
    s16 = torch.tensor(got["scores"], dtype=torch.float64).flatten()
    rho = spearmanr(s32, s16).statistic
    print(f"GPUs {world}: spearman {rho:.4f}; peak {got['peak_gib']:.2f} GiB per rank, "
          f"estimated {got['estimate_gib']:.2f}")
    assert rho >= 0.99


@pytest.fixture()
def one_rank_group(tmp_path):
    """A one-process gloo group in this process: FSDP with one shard, no spawn."""
    with _group("gloo", 0, 1, str(tmp_path / "store")):
        yield


def test_one_rank_fsdp_scores_prunes_and_guards(one_rank_group, tiny_llama_shards, tmp_path):
    one = headlab.load(tiny_llama_shards)
    single = _scored(one)
    model, reads = sharding.load_sharded(tiny_llama_shards, batch_size=2, seq_len=32)
    assert sharding.is_sharded(model) and reads.sliced
    assert reads.elements == sum(p.numel() for p in one.parameters())
    multi = _scored(model)
    _close(multi["scores"], single["scores"])
    assert multi["kept"] == single["kept"]
    sharding.save_sharded(model, tmp_path / "pruned", multi["plan"])
    pruned = headlab.prune(one, single["plan"])
    saved = headlab.load(tmp_path / "pruned")
    for k, v in pruned.state_dict().items():
        torch.testing.assert_close(saved.state_dict()[k], v, rtol=0, atol=0)
    with pytest.raises(UserError, match=r"^not enough memory: .* would fit$"):
        sharding.load_sharded(tiny_llama_shards, batch_size=10**6, seq_len=128)


def test_one_rank_fsdp_saves_a_tied_gpt2(one_rank_group, tiny_gpt2_dir, tmp_path):
    """One rank's gathered tied embedding and head share their storage, which
    safetensors refuses: each name is written as its own tensor, and the model reads
    back equal to the unsharded one."""
    one = headlab.load(tiny_gpt2_dir)
    model, _ = sharding.load_sharded(tiny_gpt2_dir)
    sharding.save_sharded(model, tmp_path / "saved")
    saved = headlab.load(tmp_path / "saved")
    for k, v in one.state_dict().items():
        torch.testing.assert_close(saved.state_dict()[k], v, rtol=0, atol=0)


@pytest.mark.parametrize("source", ["hf", "headlab"])
def test_one_rank_fsdp_runs_a_masked_lm_whose_decoder_is_the_embedding(
        one_rank_group, bpe_tokenizer, tmp_path, source):
    """BERT's MLM decoder reads the word embedding matrix: the embedding stays with the
    root unit (a unit of its own would be resharded before the head reads it), and the
    sharded model, read whole from the HF checkpoint or in rows from a headlab
    directory, gives the unsharded logits."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(bpe_tokenizer), hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=32))
    hf.save_pretrained(tmp_path / "hf")
    bpe_tokenizer.save_pretrained(tmp_path / "hf")
    one = headlab.load(tmp_path / "hf")
    assert not any(u is one.wte for u in memory.units(one))
    directory = tmp_path / "hf" if source == "hf" else one.save(tmp_path / "saved")
    model, _ = sharding.load_sharded(directory)
    ids = torch.randint(0, len(bpe_tokenizer), (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, one(ids).logits, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- repair, detect
def _halves(model):
    """Five scoring blocks and five held-out ones, 32 tokens each."""
    blocks = headlab.make_blocks(headlab.load_texts(), model.tokenizer, kind=model.kind,
                                 seq_len=32, max_tokens=32 * 2 * N_BLOCKS)
    return (blocks.subset(list(range(N_BLOCKS))),
            blocks.subset(list(range(N_BLOCKS, 2 * N_BLOCKS))))


def _plan():
    """Heads 1 and 3 of layer 0 and head 0 of layer 1 removed: both layers refitted."""
    from headlab.selection import PrunePlan

    return PrunePlan(kept={0: [0, 2], 1: [1, 2, 3]}, pruned={0: [1, 3], 1: [0]})


def _whole_state(model) -> dict[str, torch.Tensor]:
    return {k: sharding._whole(v) for k, v in model.state_dict().items()}


def _errors(report) -> list[list[float]]:
    """Each layer's errors, attention and (lsq) MLP, before and after."""
    return [[v for v in (e.error_before, e.error_after, e.mlp_error_before,
                         e.mlp_error_after) if v is not None] for e in report.layers]


def _repaired_one(model_dir, method: str):
    """The single-process repair: (repaired model, its report, held-out loss)."""
    from headlab.pruning import copy_model

    one = headlab.load(model_dir)
    scoring, heldout = _halves(one)
    pruned = headlab.prune(copy_model(one), _plan())
    report = headlab.recover(pruned, one, scoring, method=method, batch_size=2)
    return pruned, report, headlab.evaluate(pruned, heldout, batch_size=2).loss


def _repair_worker(rank: int, world: int, model_dir: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    with _group("gloo", rank, world, store):
        reference, _ = sharding.load_sharded(model_dir)
        scoring, heldout = _halves(reference)
        plan = _plan()
        found = {}
        for method in ("lsq", "bias", "rescale"):
            # no forward before the repair: the walk itself makes FSDP pick its root
            pruned, _ = sharding.load_sharded(sharding.save_sharded(
                reference, Path(out) / f"pruned-{method}", plan))
            report = headlab.recover(pruned, reference, scoring, method=method,
                                     batch_size=2)
            found[method] = {
                "loss": headlab.evaluate(pruned, heldout, batch_size=2).loss,
                "errors": _errors(report)}
            sharding.save_sharded(pruned, Path(out) / method)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_ranks_repair_like_one_process(tiny_llama_shards, tmp_path, world):
    """lsq, bias and rescale on a model sharded across two ranks, and three (uneven rows: the 64
    rows of W_O and of the down projection split 22, 22, 20), give the
    single-process repaired weights and held-out loss."""
    mp.spawn(_repair_worker, args=(world, str(tiny_llama_shards), str(tmp_path / "store"),
                                   str(tmp_path)), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for method in ("lsq", "bias", "rescale"):
        one, report, loss = _repaired_one(tiny_llama_shards, method)
        for multi in ranks:
            _close(multi[method]["loss"], loss)
            _close(multi[method]["errors"], _errors(report))
        saved = headlab.load(tmp_path / method)
        mine, theirs = saved.state_dict(), one.state_dict()
        assert mine.keys() == theirs.keys()  # the biases lsq and bias gave W_O included
        for k in theirs:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "lsq" / "model.safetensors").exists()  # written block by block


def test_one_rank_sharded_repair_failure_leaves_the_model_as_it_came(
        one_rank_group, tiny_llama_shards, tmp_path):
    """A NaN reaching layer 1's activations fails lsq after layer 0 was written into
    the shards (its W_O given a bias): the rows and the new bias are taken back."""
    reference, _ = sharding.load_sharded(tiny_llama_shards)
    scoring, _ = _halves(reference)
    pruned, _ = sharding.load_sharded(sharding.save_sharded(reference, tmp_path / "p",
                                                            _plan()))
    norm = reference.blocks[1].attn_norm.weight.to_local()
    was = norm[0].item()
    with torch.no_grad():
        norm[0] = float("nan")
    state = _whole_state(pruned)
    with pytest.raises(UserError, match="layer 1"):
        headlab.recover(pruned, reference, scoring, method="lsq", batch_size=2)
    after = _whole_state(pruned)
    assert sorted(after) == sorted(state)
    for k, v in state.items():
        assert torch.equal(after[k], v), k
    # distill's lsq start writes its rows, then LoRA is refused: the rows go back too
    with torch.no_grad():
        norm[0] = was
    with pytest.raises(UserError) as err:
        headlab.recover(pruned, reference, scoring, method="distill", params="lora")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("--recover-params lora does not run with --shard fsdp")
    after = _whole_state(pruned)
    assert sorted(after) == sorted(state)
    for k, v in state.items():
        assert torch.equal(after[k], v), k


# ---------------------------------------------------------------------- distillation
DISTILL_PARAMS = ("out", "all")


def _stop_at(step: int):
    def on_step(done: int, loss: float) -> None:
        if done == step:
            raise KeyboardInterrupt
    return on_step


def _distilled_one(model_dir, params: str):
    """The single-process lsq + distillation (one pass, 3 steps of 2 blocks): (model,
    held-out loss)."""
    from headlab.pruning import copy_model

    one = headlab.load(model_dir)
    scoring, heldout = _halves(one)
    pruned = headlab.prune(copy_model(one), _plan())
    headlab.recover(pruned, one, scoring, method="distill", params=params, batch_size=2,
                    lr=1e-3)
    return pruned, headlab.evaluate(pruned, heldout, batch_size=2).loss


def _distill_worker(rank: int, world: int, model_dir: str, store: str, out: str) -> None:
    from headlab._util.checkpoint import Checkpoint

    torch.set_num_threads(1)
    with _group("gloo", rank, world, store):
        reference, _ = sharding.load_sharded(model_dir)
        scoring, heldout = _halves(reference)
        staged = sharding.save_sharded(reference, Path(out) / "pruned", _plan())
        found = {}
        for params in DISTILL_PARAMS:
            pruned, _ = sharding.load_sharded(staged)
            report = headlab.recover(pruned, reference, scoring, method="distill",
                                     params=params, batch_size=2, lr=1e-3)
            found[params] = {"loss": headlab.evaluate(pruned, heldout, batch_size=2).loss,
                             "steps": report.options["steps"]}
            sharding.save_sharded(pruned, Path(out) / params)
        # interrupted after step 2 of 3, each rank's checkpoint holding its rows; resumed
        pruned, _ = sharding.load_sharded(staged)
        kw = dict(method="distill", params="all", batch_size=2, lr=1e-3)
        before = _whole_state(pruned)
        try:
            headlab.recover(pruned, reference, scoring, **kw,
                            checkpoint=Checkpoint(out, every=1), on_step=_stop_at(2))
        except KeyboardInterrupt:
            found["restored"] = all(torch.equal(v, before[k])
                                    for k, v in _whole_state(pruned).items())
        found["saved_step"] = Checkpoint(out).get("recover/distill")["step"]
        headlab.recover(pruned, reference, scoring, **kw, checkpoint=Checkpoint(out))
        sharding.save_sharded(pruned, Path(out) / "resumed")
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))


@pytest.mark.slow
def test_sharded_ranks_distil_like_one_process(tiny_llama_shards, tmp_path):
    """lsq then 3 AdamW steps of distillation (params out and all) on two gloo ranks give
    the single-process weights and held-out loss within 1e-5 relative (AdamW's
    normalised first steps amplify rounding differences, hence few steps); an
    interrupted sharded run resumes from the per-rank checkpoints to the same weights."""
    world = 2
    mp.spawn(_distill_worker, args=(world, str(tiny_llama_shards), str(tmp_path / "store"),
                                    str(tmp_path)), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert sorted(p.name for p in tmp_path.glob("checkpoint*.pt")) == [
        "checkpoint-rank0.pt", "checkpoint-rank1.pt"]
    for params in DISTILL_PARAMS:
        one, loss = _distilled_one(tiny_llama_shards, params)
        for multi in ranks:
            assert multi[params]["steps"] == 3
            _close(multi[params]["loss"], loss)
        mine, theirs = headlab.load(tmp_path / params).state_dict(), one.state_dict()
        assert mine.keys() == theirs.keys()
        for k in theirs:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6)
    assert all(r["restored"] and r["saved_step"] == 2 for r in ranks)
    resumed, whole = (headlab.load(tmp_path / n).state_dict() for n in ("resumed", "all"))
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=0)


# ---------------------------------------------------------------------- the model directory
def _saved(case: str, tmp_path: Path):
    """A tiny random ``case`` checkpoint of test_decoders, loaded and saved by headlab:
    (the plain model, its headlab directory)."""
    from test_decoders import _checkpoint

    model = headlab.load(_checkpoint(tmp_path / f"{case}-hf", case), tokenizer=False)
    return model, model.save(tmp_path / f"{case}-saved")


def _ids() -> torch.Tensor:
    return torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(3))


def _same_outputs(a, b) -> None:
    with torch.no_grad():
        torch.testing.assert_close(a(_ids()).logits, b(_ids()).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("case", "cls"), [("qwen3", "qwen.Qwen3"), ("gemma3", "gemma.Gemma3")])
def test_one_rank_reads_a_saved_directory_as_its_own_class(one_rank_group, tmp_path, case,
                                                           cls):
    """A saved Qwen3 (Gemma-3) directory read by the sharded reader is a Qwen3 (Gemma3),
    not the Qwen2 (Gemma2) its module names first, with the plain model's outputs; the
    sharded writer's directory reads back as that class too."""
    import importlib

    module, name = cls.split(".")
    expected = getattr(importlib.import_module(f"headlab.models.{module}"), name)
    plain, saved = _saved(case, tmp_path)
    model, reads = sharding.load_sharded(saved)
    assert reads.sliced and isinstance(model, expected)
    _same_outputs(model, plain)
    again = headlab.load(sharding.save_sharded(model, tmp_path / "resaved"), tokenizer=False)
    assert type(again) is expected
    _same_outputs(again, plain)


def test_one_rank_keeps_demotions_through_both_writers_and_readers(one_rank_group, tmp_path):
    """Demoted heads (a sink + window cache) survive the plain save read sharded and the
    sharded save read plainly: the same ``attn.streaming`` and outputs, where a window of
    3 over 12 tokens changes them."""
    from headlab.pruning import copy_model, demote
    from headlab.selection import PrunePlan

    undemoted, saved = _saved("qwen3", tmp_path)
    plan = PrunePlan(kept={0: [2, 3], 1: [0, 1]}, pruned={0: [0, 1], 1: [2, 3]}).as_demotion()
    plain = demote(copy_model(undemoted), plan, sinks=1, window=3)
    streaming = [a.streaming for a in plain.attentions]
    assert all(s is not None for s in streaming)
    with torch.no_grad():
        assert not torch.allclose(plain(_ids()).logits, undemoted(_ids()).logits)

    model, _ = sharding.load_sharded(plain.save(tmp_path / "demoted"))
    assert [a.streaming for a in model.attentions] == streaming
    _same_outputs(model, plain)

    model, _ = sharding.load_sharded(saved)
    demote(model, plan, sinks=1, window=3)
    back = headlab.load(sharding.save_sharded(model, tmp_path / "sharded"), tokenizer=False)
    assert [a.streaming for a in back.attentions] == streaming
    _same_outputs(back, plain)


def test_one_rank_reads_a_directory_its_family_upgrades(one_rank_group, tmp_path,
                                                        monkeypatch):
    """Both readers give the stored tensors to the family's `upgrade` before building: a
    renamed tensor is still read by rows, one the upgrade computes makes the sharded
    reader read the model whole; either way the model is the one saved."""
    from safetensors.torch import load_file, save_file

    plain, saved = _saved("qwen3", tmp_path)
    file = saved / "model.safetensors"
    state = load_file(str(file))
    state["old_norm.weight"] = state.pop("norm.weight")  # as an older headlab named it
    save_file(state, str(file), metadata={"format": "pt"})

    def renamed(cls, meta, state):
        state = dict(state)
        state["norm.weight"] = state.pop("old_norm.weight")
        return meta, state

    def computed(cls, meta, state):
        meta, state = renamed(cls, meta, state)
        return meta, {**state, "norm.weight": state["norm.weight"] * 1.0}

    for upgrade, sliced in ((renamed, True), (computed, False)):
        monkeypatch.setattr(type(plain), "upgrade", classmethod(upgrade))
        _same_outputs(headlab.load(saved, tokenizer=False), plain)
        model, reads = sharding.load_sharded(saved)
        assert reads.sliced is sliced
        _same_outputs(model, plain)
