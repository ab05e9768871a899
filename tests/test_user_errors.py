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
import torch
from _cli import assert_one_line, cli

import headlab
from headlab.data.blocks import split_blocks
from headlab.data.texts import TextData, bundled_text, load_texts
from headlab.errors import CorruptFileError, DataError, RunLockedError, UserError
from headlab.objectives import make_blocks

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


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
    ("prune -m smollm2-135m --keep 0.5 --method gates --gate-steps 0 --out {out}",
     "--gate-steps must be at least 1 training step, got 0"),
    ("prune -m smollm2-135m --keep 0.5 --method gates --gate-lr -0.1 --out {out}",
     "--gate-lr must be a positive learning rate, got -0.1"),
    ("prune -m smollm2-135m --keep 0.5 --method gates --gate-lagrange-lr 0 --out {out}",
     "--gate-lagrange-lr must be a positive learning rate, got 0"),
    ("prune -m smollm2-135m --keep 0.5 --method gates --gate-batch 0 --out {out}",
     "--gate-batch must be at least 1 block per step, got 0"),
    ("score -m smollm2-135m --method gates --prune 270 --out {out}", "has 270 attention heads"),
    ("score -m {model} --method gates --out {out}", "give --keep FRACTION or --prune N"),
    ("score -m {model} --method michel --keep 0.5 --out {out}", "set the target of gates"),
    ("prune -m {model} --keep 0.5 --method random --normalize --out {out}",
     "--normalize does not apply to --method random"),
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
    with pytest.raises(UserError, match="--normalize does not apply to --method random"):
        headlab.score(tiny_gpt2, blocks, method="random", normalize=True)
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
    import headlab.runs.pipeline

    def broken(cfg):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(headlab.runs.pipeline, "load_model", broken)
    with pytest.raises(ZeroDivisionError):
        cli(capsys, "score", "-m", str(tiny_gpt2_dir), "--out", str(tmp_path / "run"))


# ---------------------------------------------------------------- one run per directory
def test_two_runs_on_one_out_one_proceeds_the_other_names_it(capsys, tiny_gpt2_dir, tmp_path):
    from headlab.runs import lock as runlock

    out = tmp_path / "run"
    text = tmp_path / "long.txt"  # ablation on this runs for minutes: the first run lives
    text.write_text("\n\n".join([bundled_text()] * 10))
    first = subprocess.Popen(
        [sys.executable, "-m", "headlab", "score", "-m", str(tiny_gpt2_dir), "--method",
         "ablation", "--data", str(text), "--max-tokens", "200000", "--seq-len", "32",
         "--out", str(out), "-q"], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 600  # a loaded machine can take minutes to start it
        while not (out / "status.json").exists():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()
            time.sleep(0.1)
        for args in (["score", "-m", str(tiny_gpt2_dir), "--out", str(out), "--overwrite"],
                     ["score", "--resume", str(out)]):
            code, _, err = cli(capsys, *args)
            assert_one_line(code, err, f"in use by process {first.pid}")
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()
    # the killed run's lock file stays, but no process holds it: the next run takes over
    assert (out / runlock.LOCK_NAME).is_file() and runlock.holder(out) is None
    lock = runlock.RunLock(out)
    assert runlock.holder(out) == os.getpid()
    with pytest.raises(RunLockedError, match=f"in use by process {os.getpid()}"):
        runlock.RunLock(out)
    lock.release()
    assert runlock.holder(out) is None


# ---------------------------------------------------------------- a full disk
def test_full_disk_during_the_model_save_fails_the_run_cleanly(capsys, monkeypatch,
                                                               tiny_gpt2_dir, tmp_path):
    """safetensors reports a full disk in its own error: it ends as the OSError it is,
    status.json says failed and nothing of the model is left to pass for complete."""
    from safetensors import SafetensorError

    import headlab.models.format

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(headlab.models.format, "save_file", full_disk)
    out = tmp_path / "run"
    text = tmp_path / "text.txt"
    text.write_text(bundled_text()[:20_000])
    code, _, err = cli(capsys, "prune", "-m", str(tiny_gpt2_dir), "--keep", "0.5", "--method",
                       "random", "--schedule", "one-shot", "--recover", "none", "--data",
                       str(text), "--max-tokens", "512", "--seq-len", "32", "--out", str(out),
                       "-q")
    assert_one_line(code, err, "No space left on device")
    assert f"{out / 'model' / 'model.safetensors'}: No space left on device" in err
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed" and "No space left" in status["error"]
    assert not (out / "results.json").exists() and not (out / "model").exists()
    assert not list(out.rglob("*.tmp"))


# ---------------------------------------------------------------- corrupt model files
GGUF = "smollm2-135m"


def _corrupt_model(kind: str, how: str, cut: float, seed: int, where: Path, tiny: Path,
                   gguf_span: int) -> tuple[Path, Path, bytes | None]:
    """A model whose ``kind`` file is replaced by random bytes or cut short; returns
    (what to pass to --model, the corrupted file, the original bytes when small)."""
    import random

    rng = random.Random(seed)
    if kind == "gguf":
        from headlab.models.loading import bundled_path

        source = bundled_path(GGUF)
        target = where / "m.gguf"
        with open(source, "rb") as f:
            data = (f.read(int(cut * gguf_span)) if how == "truncate"
                    else rng.randbytes(int(cut * 4096)))
        target.write_bytes(data)
        return target, target, None
    model = where / "m"
    shutil.copytree(tiny, model)
    target = model / ("model.safetensors" if kind == "safetensors" else "config.json")
    original = target.read_bytes()
    data = (original[: min(int(cut * len(original)), len(original) - 1)] if how == "truncate"
            else rng.randbytes(int(cut * 4096)))
    target.write_bytes(data)
    return model, target, original


def _check_corrupt_eval(capsys, tmp_path_factory, tiny, kind, how, cut, seed, gguf_span):
    where = tmp_path_factory.mktemp("corrupt")
    model, target, original = _corrupt_model(kind, how, cut, seed, where, tiny, gguf_span)
    start = time.perf_counter()
    code, _, err = cli(capsys, "eval", "-m", str(model), "--max-tokens", "256", "--seq-len",
                       "32", "-q")
    assert time.perf_counter() - start < 60  # refused from the header, nothing converted
    if code == 0:  # a cut that kept the JSON whole (its final newline) is no corruption
        assert kind == "config" and json.loads(target.read_bytes()) == json.loads(original)
        return
    culprit = str(target) if kind != "config" else f"{target}"
    assert_one_line(code, err, culprit)
    shutil.rmtree(where)


_KINDS = ("safetensors", "config", "gguf")


@pytest.fixture()
def cache_in_tmp(monkeypatch, tmp_path_factory):
    """GGUF conversions (there must be none) go to a throwaway cache."""
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path_factory.mktemp("cache")))


def _corrupt_eval_test(max_examples: int, gguf_span: int):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=max_examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(kind=st.sampled_from(_KINDS), how=st.sampled_from(("truncate", "random")),
           cut=st.floats(0, 1), seed=st.integers(0, 2**32 - 1))
    def test(capsys, tmp_path_factory, tiny_gpt2_dir, cache_in_tmp, kind, how, cut, seed):
        _check_corrupt_eval(capsys, tmp_path_factory, tiny_gpt2_dir, kind, how, cut, seed,
                            gguf_span)

    return test


# default suite: a few examples, GGUF cut within its 1.8 MB header and tensor table
test_corrupt_model_files_end_in_one_line = pytest.mark.real(_corrupt_eval_test(12, 2_500_000))
# slow: many more, GGUF cut anywhere in its 98 MB
test_corrupt_model_files_end_in_one_line_many = pytest.mark.slow(pytest.mark.real(
    _corrupt_eval_test(60, 98_362_432)))


# ---------------------------------------------------------------- killed, then resumed
def _prune_args(model: Path, out: Path, data: Path) -> list[str]:
    return ["prune", "-m", str(model), "--keep", "0.5", "--step", "0.25", "--data", str(data),
            "--max-tokens", "4096", "--seq-len", "32", "--batch-size", "2", "--out", str(out),
            "-q"]


def _kill_at(moment, args: list[str], out: Path) -> bool:
    """Start a run and SIGKILL it once ``moment(out)`` holds; False if it ended first."""
    proc = subprocess.Popen([sys.executable, "-m", "headlab", *args], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            if out.is_dir() and moment(out):
                proc.kill()
                return True
            time.sleep(0.001)
        return False
    finally:
        proc.kill()
        proc.wait()


def _staging(pattern: str):
    return lambda out: any(out.glob(pattern))


MOMENTS = {
    "after loading": lambda out: (out / "status.json").exists(),
    "while scoring": lambda out: (out / "checkpoint.pt").exists(),
    "during a checkpoint write": _staging(".checkpoint.pt.*.tmp"),
    "during the model save": _staging(".model.*.tmp"),
}


@pytest.fixture(scope="module")
def uninterrupted(tiny_gpt2_dir, tmp_path_factory):
    """The data and the directory of a prune run left alone."""
    where = tmp_path_factory.mktemp("uninterrupted")
    data = where / "text.txt"
    data.write_text(bundled_text())
    full = where / "full"
    r = subprocess.run([sys.executable, "-m", "headlab", *_prune_args(tiny_gpt2_dir, full, data)],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    return data, full


@pytest.mark.slow
@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_killed_at_any_moment_resumes_to_the_same_run_and_no_temp_file(
        tiny_gpt2_dir, tmp_path, uninterrupted, moment):
    from headlab.runs import lock as runlock

    data, full = uninterrupted
    cut = tmp_path / "cut"
    for _ in range(5):  # a moment of a few milliseconds can be missed: try again
        shutil.rmtree(cut, ignore_errors=True)
        if _kill_at(MOMENTS[moment], _prune_args(tiny_gpt2_dir, cut, data), cut):
            break
    else:
        pytest.fail(f"the run always ended before the moment {moment!r}")
    r = subprocess.run([sys.executable, "-m", "headlab", "prune", "--resume", str(cut), "-q"],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    a = json.loads((full / "results.json").read_text())
    b = json.loads((cut / "results.json").read_text())
    for key in ("importance", "kept_heads", "curve", "heads_kept", "quality", "params"):
        assert a[key] == b[key], key
    assert (full / "model" / "model.safetensors").read_bytes() == (
        cut / "model" / "model.safetensors").read_bytes()
    assert json.loads((cut / "status.json").read_text())["status"] == "complete"
    assert not list(cut.rglob("*.tmp")) and runlock.holder(cut) is None
    assert not (cut / "checkpoint.pt").exists()


@pytest.mark.slow
def test_a_real_full_disk_fails_the_run_cleanly(tiny_gpt2_dir, tmp_path):
    """A tmpfs too small for the model: the same ending as the monkeypatched writer."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (test_full_disk_during_the_model_save_... "
                    "covers the same ending with a failing writer)")
    try:
        data = tmp_path / "text.txt"
        data.write_text(bundled_text()[:20_000])
        out = disk / "run"
        r = subprocess.run(
            [sys.executable, "-m", "headlab", "prune", "-m", str(tiny_gpt2_dir), "--keep",
             "0.5", "--method", "random", "--schedule", "one-shot", "--recover", "none",
             "--data", str(data), "--max-tokens", "512", "--seq-len", "32", "--out", str(out),
             "-q"], capture_output=True, text=True, env=ENV, timeout=600)
        errors = [line for line in r.stderr.splitlines() if not line.startswith("warning:")]
        assert_one_line(r.returncode, "\n".join(errors), "No space left on device")
        assert "MB free" in r.stderr  # warned before the model loaded
        assert json.loads((out / "status.json").read_text())["status"] == "failed"
        assert not (out / "results.json").exists() and not (out / "model").exists()
        assert not list(out.rglob("*.tmp"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_ctrl_c_before_the_run_directory_exists_names_none(capsys, monkeypatch, tiny_gpt2_dir,
                                                           tmp_path):
    import headlab.runs.pipeline

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(headlab.runs.pipeline, "load_model", interrupted)
    code, _, err = cli(capsys, "score", "-m", str(tiny_gpt2_dir), "--out", str(tmp_path / "r"))
    assert code == 130 and "nothing to resume" in err and "--resume" not in err
    assert not (tmp_path / "r").exists()


def test_files_follow_the_umask_and_stale_temps_are_removed(tmp_path):
    from safetensors.torch import save_file

    from headlab._util.io import atomic_dir, atomic_path
    from headlab.runs.lock import remove_stale_temps

    old = os.umask(0o027)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(3)}, str(tmp))  # safetensors replaces the file
        with atomic_dir(tmp_path / "model") as staging:
            (staging / "config.json").write_text("{}")
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "model").stat().st_mode & 0o777 == 0o750
    (tmp_path / ".results.json.x1.tmp").write_text("half")
    (tmp_path / ".model.x2.tmp").mkdir()
    (tmp_path / "model" / ".model.safetensors.x3.tmp").write_text("half")
    removed = remove_stale_temps(tmp_path)
    assert len(removed) == 3 and not list(tmp_path.rglob("*.tmp"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.safetensors"]


def test_a_broken_run_directory_is_named_on_resume(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"model": "minilm-l6", "command": "score"}')
    (run / "status.json").write_text('{"status": "runn')
    code, _, err = cli(capsys, "score", "--resume", str(run))
    assert_one_line(code, err, f"broken run status: {run / 'status.json'} line 1")
    (run / "status.json").write_text('{"status": "interrupted"}')
    (run / "config.json").write_text("[1, 2]")
    code, _, err = cli(capsys, "score", "--resume", str(run))
    assert_one_line(code, err, f"broken run configuration: {run / 'config.json'} holds a JSON list")
