"""Two gloo processes on CPU give the single-process result (issue: torchrun scaling)."""

from __future__ import annotations

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
from headlab.parallel import distributed

ROOT = Path(__file__).resolve().parents[1]
N_BLOCKS = 7  # odd: the shards are 4 and 3 blocks, the last batch short


def _pipeline(model_dir: str) -> dict:
    """Score, evaluate and prune on 7 blocks; everything that must not depend on ranks."""
    model = headlab.load(model_dir)
    blocks = headlab.make_blocks(headlab.load_texts(), model.tokenizer, kind=model.kind,
                                 seq_len=32, max_tokens=32 * 2 * N_BLOCKS)
    blocks = blocks.subset(list(range(N_BLOCKS)))
    scores = {m: headlab.score(model, blocks, method=m, batch_size=2, normalize=False)
              for m in ("michel", "fisher", "ablation", "entropy")}
    quality = headlab.evaluate(model, blocks, batch_size=2)
    total = model.n_layers * model.n_original_heads
    res = headlab.prune_to_target(model, blocks, blocks, method="michel",
                                  n_keep=headlab.heads_to_keep(total, keep=0.5), step=0.25,
                                  batch_size=2)
    return {
        "scores": {m: s.scores for m, s in scores.items()},
        "n_tokens": scores["michel"].n_tokens,
        "loss": quality.loss, "eval_tokens": quality.n_tokens,
        "kept": {str(k): v for k, v in res.plan.kept.items()},
        "curve": [p.to_json() for p in res.curve],
        "few": _few(model, blocks),
    }


def _few(model, blocks) -> dict:
    """Fewer batches than ranks: 3 blocks (ranks take 1 and 2 examples) and 1 block (rank 0
    takes none and contributes zeros), in batches of 8."""
    out = {}
    for n in (3, 1):
        part = blocks.subset(list(range(n)))
        out[str(n)] = {
            "scores": {m: headlab.score(model, part, method=m, batch_size=8,
                                        normalize=False).scores
                       for m in ("michel", "entropy")},
            "loss": headlab.evaluate(model, part, batch_size=8).loss,
        }
    return out


def _worker(rank: int, model_dir: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        assert distributed.active() and distributed.world_size() == 2
        # batches of 2 dealt out: rank 0 gets [0, 1], [4, 5]; rank 1 [2, 3], [6]
        assert distributed.shard_rows(N_BLOCKS, 2) == [[0, 1, 4, 5], [2, 3, 6]][rank]
        # one batch of 3 or of 1 for two ranks: the examples are shared out
        assert distributed.shard_rows(3, 8) == [[0], [1, 2]][rank]
        assert distributed.shard_rows(1, 8) == [[], [0]][rank]
        result = _pipeline(model_dir)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _close(a, b, rel=1e-6):
    ta = torch.tensor(a, dtype=torch.float64)
    tb = torch.tensor(b, dtype=torch.float64)
    torch.testing.assert_close(ta, tb, rtol=rel, atol=1e-12, equal_nan=True)


def test_two_gloo_ranks_equal_one_process(tiny_gpt2_dir, tmp_path):
    single = _pipeline(str(tiny_gpt2_dir))
    out = tmp_path / "rank0.json"
    mp.spawn(_worker, args=(str(tiny_gpt2_dir), str(tmp_path / "store"), str(out)),
             nprocs=2, join=True)
    multi = json.loads(out.read_text())
    for method in single["scores"]:
        _close(multi["scores"][method], single["scores"][method])
    assert multi["n_tokens"] == single["n_tokens"]  # no block dropped or counted twice
    assert multi["eval_tokens"] == single["eval_tokens"] == N_BLOCKS * 32
    _close(multi["loss"], single["loss"])
    assert multi["kept"] == single["kept"]
    _close([p["quality"] for p in multi["curve"]], [p["quality"] for p in single["curve"]])
    for n, one in single["few"].items():  # other batch shapes than one process: 1e-5
        for method, s in one["scores"].items():
            _close(multi["few"][n]["scores"][method], s, rel=1e-5)
        _close(multi["few"][n]["loss"], one["loss"], rel=1e-5)


@pytest.mark.slow
def test_torchrun_cli_scores_like_one_process(tiny_gpt2_dir, tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun comes with torch; the venv should have it"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # michel: taylor's curvature probes are drawn per rank, so two ranks draw other probes
    common = ["score", "--model", str(tiny_gpt2_dir), "--method", "michel", "--max-tokens",
              "1216", "--seq-len", "32", "--batch-size", "2", "-q"]
    one = subprocess.run([sys.executable, "-m", "headlab", *common, "--out",
                          str(tmp_path / "one")], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "headlab",
                          *common, "--out", str(tmp_path / "two")], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert two.returncode == 0, two.stderr
    a = json.loads((tmp_path / "one" / "results.json").read_text())
    b = json.loads((tmp_path / "two" / "results.json").read_text())
    _close(b["importance"], a["importance"])
    assert a["data"]["scoring_tokens"] == b["data"]["scoring_tokens"]
    assert b["quality"]["before"] == pytest.approx(a["quality"]["before"], rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bfloat16_on_gpu_matches_float32(tiny_gpt2_dir):
    from scipy.stats import spearmanr

    ref = headlab.load(tiny_gpt2_dir, device="cuda", dtype=torch.float32)
    low = headlab.load(tiny_gpt2_dir, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 500, (4, 64), device="cuda")
    a, b = ref(ids).logits.float(), low(ids).logits.float()
    assert ((a - b).norm() / a.norm()).item() < 1e-2
    blocks = headlab.make_blocks(headlab.load_texts(), ref.tokenizer, kind=ref.kind,
                                 seq_len=64, max_tokens=4096)
    s32 = headlab.score(ref, blocks, method="michel").tensor().flatten()
    s16 = headlab.score(low, blocks, method="michel").tensor().flatten()
    assert spearmanr(s32, s16).statistic >= 0.95
