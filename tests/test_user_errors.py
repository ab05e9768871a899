"""Every failure a user can cause: one line on stderr, exit code 2, early, nothing left.

Most cases run the real entry point (`headlab.cli.main`, the console script's) in this
process with its stderr captured, which is what a subprocess would see minus three
seconds of imports; `test_a_subprocess_sees_the_same_line` runs a few as a user does.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import headlab
from headlab.data import TextData, bundled_text, load_texts, make_blocks, split_blocks
from headlab.errors import CorruptFileError, DataError, RunLockedError, UserError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `headlab ARGS` through the console script's entry point in this process."""
    from headlab import cli as cli_module

    argv = sys.argv
    sys.argv = ["headlab", *args]
    try:
        cli_module.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, culprit: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and culprit in lines[0], err
    assert "Traceback" not in err


# ---------------------------------------------------------------- bad files, built once
@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_gpt2_dir):
    """Files a hostile user would hand over, each beside the culprit it must name."""
    d = tmp_path_factory.mktemp("bad")
    files = {}

    def model_copy(name: str) -> Path:
        path = d / name
        shutil.copytree(tiny_gpt2_dir, path)
        return path

    m = model_copy("truncated")
    st = m / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    files["truncated"] = m
    m = model_copy("empty")
    (m / "model.safetensors").write_bytes(b"")
    files["empty"] = m
    m = model_copy("random")
    (m / "model.safetensors").write_bytes(os.urandom(4096))
    files["random"] = m
    m = model_copy("lying")  # a header whose first tensor claims a bigger shape
    raw = (m / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [s * 2 for s in header[name]["shape"]]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    (m / "model.safetensors").write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    files["lying"] = m
    m = model_copy("badconfig")
    (m / "config.json").write_text('{"model_type": "gpt2", "n_layer": 3,,}')
    files["badconfig"] = m
    gguf = d / "huge.gguf"  # 24 bytes claiming 2**40 tensors
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 1))
    files["gguf"] = gguf
    noise = d / "noise.txt"
    noise.write_bytes(os.urandom(20_000))
    files["noise"] = noise
    nul = d / "nul.txt"
    nul.write_text("A perfectly ordinary sentence.\x00 And another one.\n")
    files["nul"] = nul
    jsonl = d / "rows.jsonl"
    jsonl.write_text('{"text": "one"}\n{"text": "two"\n{"text": "three"}\n')
    files["jsonl"] = jsonl
    csv = d / "rows.csv"
    csv.write_text('text,label\n"fine",1\n"never closed,0\nmore,1\n')
    files["csv"] = csv
    wide = d / "wide.csv"
    wide.write_text("text,label\nfine,1\none,too,many\n")
    files["wide"] = wide
    recipe = d / "typo.toml"
    recipe.write_text('model = "minilm-l6"\nkeep = 0.5\nmethd = "michel"\n')
    files["typo"] = recipe
    afile = d / "a-file"
    afile.write_text("not a directory")
    files["afile"] = afile
    return files


# (command line, what the line must name); {name} is a path from `bad`, {model} the tiny
# GPT-2, {out} a fresh run directory that must not exist afterwards
CASES = [
    ("prune -m {model} --prune 1000 --out {out}", "has 12 attention heads"),
    ("prune -m minilm-l6 --prune 72 --out {out}", "has 72 attention heads"),
    ("prune -m smollm2-135m --prune 500 --out {out}", "has 270 attention heads"),
    ("prune -m {model} --keep 0.5 --out {afile}", "is a file"),
    ("prune -m {model} --keep 0.5 --out {afile}/run", "is a file"),
    ("prune -m {model} --keep 0.5 --data a:b:c:d:e --out {out}", "'a:b:c:d:e' is not a dataset"),
    ("prune -m {model} --keep 0.5 --data {noise} --out {out}", "noise.txt is not text"),
    ("prune -m {model} --keep 0.5 --data {nul} --out {out}", "(the first at byte 30)"),
    ("prune -m {model} --keep 0.5 --data {jsonl} --out {out}", "rows.jsonl line 2"),
    ("prune -m {model} --keep 0.5 --data {csv} --out {out}", "rows.csv line 4"),
    ("prune -m {model} --keep 0.5 --data {wide} --out {out}", "wide.csv line 3: 3 fields"),
    ("score -m {model} --data {jsonl} --out {out}", "rows.jsonl line 2"),
    ("prune -m {model} --keep abc", "'--keep'"),
    ("prune -m {model} --keep 0.5 --method bogus", "'bogus' is not one of"),
    ("prune -m {model} --kep 0.5", "No such option: --kep"),
    ("prune -m {model} --keep 1.5 --out {out}", "--keep must be in (0, 1]"),
    ("run {typo}", "unknown key(s) ['methd']"),
    ("eval -m {truncated}", "truncated or corrupt: {truncated}/model.safetensors"),
    ("eval -m {empty}", "truncated or corrupt: {empty}/model.safetensors"),
    ("eval -m {random}", "truncated or corrupt: {random}/model.safetensors"),
    ("eval -m {lying}", "truncated or corrupt: {lying}/model.safetensors"),
    ("eval -m {badconfig}", "broken config: {badconfig}/config.json line 1"),
    ("eval -m {gguf}", "truncated or corrupt: {gguf}"),
    ("eval -m {model} --data {noise}", "noise.txt is not text"),
    ("prune -m {truncated} --keep 0.5 --out {out}", "truncated or corrupt"),
    ("score --resume {out}", "has no config.json"),
]


@pytest.mark.parametrize(("command", "culprit"), CASES, ids=[c for c, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, bad, tiny_gpt2_dir, command,
                                          culprit):
    names = {k: str(v) for k, v in bad.items()} | {"model": str(tiny_gpt2_dir),
                                                   "out": str(tmp_path / "run")}
    start = time.perf_counter()
    code, _, err = cli(capsys, *command.format(**names).split())
    assert_one_line(code, err, culprit.format(**names))
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    assert time.perf_counter() - start < 60  # before any model is loaded or data tokenised


def test_a_subprocess_sees_the_same_line(bad, tiny_gpt2_dir, tmp_path):
    """The console script itself: exit code, one line, no traceback, no run directory."""
    for args, culprit in (
            (["prune", "-m", str(tiny_gpt2_dir), "--keep", "abc"], "'--keep'"),
            (["eval", "-m", str(bad["lying"])], "truncated or corrupt"),
            (["prune", "-m", str(tiny_gpt2_dir), "--prune", "12", "--out",
              str(tmp_path / "run")], "has 12 attention heads")):
        r = subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True,
                           text=True, env=ENV, timeout=300)
        assert_one_line(r.returncode, r.stderr, culprit)
    assert not (tmp_path / "run").exists()


def test_read_only_out_is_refused_naming_it(capsys, tmp_path, tiny_gpt2_dir):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(ro)],
                             capture_output=True).returncode == 0
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("cannot mount a read-only tmpfs, and root writes through chmod")
        ro.chmod(0o555)
    try:
        code, _, err = cli(capsys, "prune", "-m", str(tiny_gpt2_dir), "--keep", "0.5",
                           "--out", str(ro / "run"))
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)
        ro.chmod(0o755)
    assert_one_line(code, err, f"{ro} is not writable")


# ---------------------------------------------------------------- the Python API
def test_api_arguments_are_checked_with_user_errors(tiny_gpt2):
    tok = tiny_gpt2.tokenizer
    data = TextData([bundled_text()[:2000]])
    with pytest.raises(DataError, match="make_blocks reads TextData .* got list"):
        make_blocks([], tok, kind="causal-lm", seq_len=32)
    with pytest.raises(DataError, match="no texts"):
        make_blocks(TextData([]), tok, kind="causal-lm", seq_len=32)
    with pytest.raises(DataError, match="no text layout for model kind 'nonsense'"):
        make_blocks(data, tok, kind="nonsense", seq_len=32)
    with pytest.raises(DataError, match="split_blocks takes Blocks .* got list"):
        split_blocks([])
    with pytest.raises(DataError, match="score takes Blocks .* got list"):
        headlab.score(tiny_gpt2, [])
    with pytest.raises(DataError, match="score takes Blocks .* got NoneType"):
        headlab.score(tiny_gpt2, None)
    with pytest.raises(DataError, match="evaluate takes Blocks .* got list"):
        headlab.evaluate(tiny_gpt2, [])
    blocks = make_blocks(data, tok, kind="causal-lm", seq_len=32)
    with pytest.raises(DataError, match="holds no blocks"):
        headlab.evaluate(tiny_gpt2, blocks.subset([]))
    rows = make_blocks(data, tok, kind="embedding", seq_len=32)
    for fn in (headlab.evaluate, headlab.score, headlab.prepare):
        with pytest.raises(DataError, match="laid out as 'sentences', a causal-lm model reads "
                                            "'stream'"):
            fn(tiny_gpt2, rows)
    # the layout travels with subsets and prepared blocks, and right blocks still work
    assert split_blocks(blocks)[0].layout == headlab.prepare(tiny_gpt2, blocks).layout == "stream"
    assert headlab.evaluate(tiny_gpt2, blocks).n_tokens == blocks.n_tokens


@pytest.mark.real
def test_lm_blocks_on_an_embedding_model_are_refused():
    model = headlab.load("minilm-l6")
    lm_blocks = make_blocks(load_texts(None), model.tokenizer, kind="causal-lm", seq_len=32,
                            max_tokens=256)
    with pytest.raises(DataError, match="a embedding model reads 'sentences'"):
        headlab.evaluate(model, lm_blocks)


def test_errors_are_value_errors_and_user_errors():
    for cls in (CorruptFileError, RunLockedError, DataError):
        assert issubclass(cls, UserError) and issubclass(cls, ValueError)
    assert RunLockedError("x", pid=7).pid == 7


def test_a_programming_error_keeps_its_traceback(capsys, monkeypatch, tiny_gpt2_dir, tmp_path):
    """Not every exception is bad input: a bug exits 1 with its traceback."""
    import headlab.runs

    def broken(cfg):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(headlab.runs, "load_model", broken)
    with pytest.raises(ZeroDivisionError):
        cli(capsys, "score", "-m", str(tiny_gpt2_dir), "--out", str(tmp_path / "run"))
