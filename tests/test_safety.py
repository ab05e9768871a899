"""Nothing unsafe is loaded; a killed write leaves the old file or the new one."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

import headlab


class _RunsCode:
    """Unpickling this calls os.system: a pickle that would run code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused(tiny_gpt2_dir, tmp_path):
    model_dir = tmp_path / "evil"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((tiny_gpt2_dir / "config.json").read_text())
    marker = tmp_path / "pwned"
    with open(model_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump({"transformer.wte.weight": _RunsCode(marker)}, f)
    with pytest.raises(ValueError, match="refused to load .*weights_only=True"):
        headlab.load(model_dir)
    assert not marker.exists()


def test_plain_bin_checkpoint_loads_with_weights_only(tiny_gpt2_dir, tmp_path):
    from safetensors.torch import load_file

    state = load_file(str(tiny_gpt2_dir / "model.safetensors"))
    model_dir = tmp_path / "bin"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((tiny_gpt2_dir / "config.json").read_text())
    torch.save(state, model_dir / "pytorch_model.bin")
    ref = headlab.load(tiny_gpt2_dir, tokenizer=False)
    got = headlab.load(model_dir, tokenizer=False)
    ids = torch.randint(0, 100, (1, 12))
    torch.testing.assert_close(got(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_headlab_dir_with_wrong_shapes_is_rejected_by_name(tiny_gpt2, tmp_path):
    tiny_gpt2.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    meta["config"]["n_inner"] = 64  # the saved MLP weights are 4 * 32 = 128 wide
    (tmp_path / "m" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"wrong shapes .*blocks\.0\.mlp\.fc\.weight"):
        headlab.load(tmp_path / "m")


def test_headlab_dir_with_unknown_config_key_is_rejected(tiny_gpt2, tmp_path):
    tiny_gpt2.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    meta["config"]["n_experts"] = 8
    (tmp_path / "m" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"unknown GPT2Config keys \['n_experts'\]"):
        headlab.load(tmp_path / "m")


_WRITER = """
import sys
from headlab._util.io import atomic_write_json
path = sys.argv[1]
i = 0
while True:
    atomic_write_json(path, {"i": i, "payload": list(range(200_000))})
    i += 1
"""


def test_killed_writer_leaves_complete_json_or_nothing(tmp_path):
    target = tmp_path / "results.json"
    for delay in (0.5, 1.3, 2.1):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)])
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if target.exists():
            data = json.loads(target.read_text())  # never truncated
            assert len(data["payload"]) == 200_000
    leftovers = list(tmp_path.glob(".results.json.*.tmp"))
    assert len(leftovers) <= 3  # a killed process cannot clean its temp file; never renamed


def test_nan_weights_are_refused_at_load(tiny_gpt2, tmp_path):
    with torch.no_grad():
        tiny_gpt2.blocks[1].attn.q_proj.weight[0, 0] = float("nan")
    tiny_gpt2.save(tmp_path / "m")
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.q_proj\.weight.*NaN or inf"):
        headlab.load(tmp_path / "m")
