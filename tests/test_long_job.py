"""A long job you can trust, through the real DeepSpeed launcher on 2 CPU ranks (each run bounded by a
timeout):

    exact resume     a run left after step 10 (--stop-after) and resumed to 20 == a straight 20-step run:
                     losses of steps 11-20 and the exported parameters bitwise, the LR schedule
                     continues (TensorBoard's Train/lr too); tiny-llama TP=2 SI, tiny-phimoe EP=2 SI,
                     PP=2 W, CP=2 (Ulysses). A resume that would change the run is refused naming both values.
    checkpoints      --save-interval keeps the newest --keep-checkpoints, ``latest`` names the newest;
                     what an interrupted save left is removed at the next start
    stops            SIGTERM to the launcher: every rank gone within 20 s, non-zero exit, and with
                     --save-on-signal the checkpoint resumes to the losses of an uninterrupted run;
                     SIGKILL of one rank: the other exits within 15 s with one line naming the
                     collective and the peer
    HF export        a failure in the middle of a save leaves the previous export and no temporary folder
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
LAYOUTS = {
    "llama-tp2-si": ("tiny_llama_cpu.json", "tiny-llama"),
    "phimoe-ep2-si": ("phimoe_ep2.json", "tiny-phimoe"),
    "llama-pp2-w": ("tiny_llama_pp2_w.json", "tiny-llama"),
    "llama-cp2-si": ("tiny_llama_cp2.json", "tiny-llama"),
}


def _config(tmp, name: str, tb: bool = False, scheduler: bool = True) -> str:
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        cfg = json.load(f)
    cfg["tensorboard"] = {"enabled": tb, "output_path": str(tmp / "tb"), "job_name": "run"}
    if not scheduler:
        cfg.pop("scheduler")
    path = tmp / f"ds-{name}"
    path.write_text(json.dumps(cfg))
    return str(path)


def _cmd(cfg: str, model: str, out, *extra) -> list[str]:
    return [
        DEEPSPEED,
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, "train.py"),
        "--deepspeed",
        cfg,
        "--model",
        model,
        "--seq-len",
        "32",
        "--output-dir",
        str(out),
        *extra,
    ]


def _run(cmd, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _weights(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(str(path), "*.safetensors"))):
        out.update(load_file(f))
    return out


def _summary(path) -> dict:
    with open(path) as f:
        return json.load(f)


TOTAL, STOP = 20, 10  # the resumed half runs in the cosine decay, after the configs' 10 warm-up steps


EXTENDED_LAYOUTS = ("llama-cp2-si", "phimoe-ep2-si")  # (in the extended tier: the CI budget)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=pytest.mark.extended) if k in EXTENDED_LAYOUTS else k for k in sorted(LAYOUTS)]
)
def test_stop_and_resume_equals_a_straight_run(tmp_path, layout, straight_run):
    """llama-tp2-si leaves after step 10 (--stop-after) and resumes with --resume auto; the other
    layouts resume from the straight run's own step-10 checkpoint (--save-interval): the same
    save and load, one launch fewer. The straight run is shared (``conftest.straight_run``)."""
    name, model = LAYOUTS[layout]
    stops = layout == "llama-tp2-si"
    cfg = _config(tmp_path, name, tb=stops)
    straight = straight_run(layout)
    full = straight["summary"]
    if stops:
        ck = tmp_path / "ck"
        first = _run(
            _cmd(
                cfg,
                model,
                tmp_path / "a",
                "--steps",
                str(TOTAL),
                "--stop-after",
                str(STOP),
                "--ds-checkpoint",
                str(ck),
                "--json-summary",
                str(tmp_path / "a.json"),
            )
        )
        _ok(first)
        assert f"leaving after step {STOP} of {TOTAL}" in first.stdout
        assert not (tmp_path / "a").exists()  # an intermediate stop exports nothing
        (ck / ".tmp-global_step99").mkdir()  # what an interrupted save would leave
        resume, before = ["--resume", "auto", "--ds-checkpoint", str(ck)], _summary(tmp_path / "a.json")
    else:
        ck = straight["ck"]
        resume, before = ["--resume", str(ck / f"global_step{STOP}"), "--ds-checkpoint", str(tmp_path / "ck2")], None
    _ok(
        _run(
            _cmd(cfg, model, tmp_path / "b", "--steps", str(TOTAL), *resume, "--json-summary", str(tmp_path / "b.json"))
        )
    )
    b = _summary(tmp_path / "b.json")
    assert b["start_step"] == STOP and len(b["losses"]) == TOTAL - STOP
    assert b["losses"] == full["losses"][STOP:] and b["lrs"] == full["lrs"][STOP:]  # bitwise: the same floats
    assert b["lrs"][0] > 0
    want, got = straight["weights"], _weights(tmp_path / "b")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert {f"global_step{TOTAL}", f"global_step{STOP}", "latest"} <= set(os.listdir(ck))
    if stops:
        assert before["losses"] == full["losses"][:STOP] and before["lrs"] == full["lrs"][:STOP]
        assert not (ck / ".tmp-global_step99").exists()
        _lr_continues_in_tensorboard(tmp_path / "tb", full["lrs"])  # written by the stopped and the resumed run


def _lr_continues_in_tensorboard(tb_dir, lrs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = {}
    for f in glob.glob(str(tb_dir / "**" / "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(f)
        acc.Reload()
        if "Train/lr" in acc.Tags()["scalars"]:
            logged.update({e.step: e.value for e in acc.Scalars("Train/lr")})
    assert sorted(logged) == list(range(1, TOTAL + 1)), sorted(logged)  # before the stop, then after the resume
    assert logged[STOP + 1] > 0 and [logged[s] for s in range(1, TOTAL + 1)] == pytest.approx(lrs, rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_that_changes_the_run_is_refused(tmp_path, straight_run):
    straight = straight_run("llama-tp2-si")  # a TOTAL-step run of tiny_llama_cpu.json at --seq-len 32
    cfg, ck = straight["cfg"], straight["ck"]
    env = dict(os.environ, WORLD_SIZE="2")
    for extra, words in (
        (["--steps", "30"], ["total_steps", f"checkpoint {TOTAL}, this run 30"]),
        (["--steps", str(TOTAL), "--seq-len", "64"], ["seq_len", "checkpoint 32, this run 64"]),
    ):
        argv = [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--deepspeed",
            cfg,
            "--seq-len",
            "32",
            "--resume",
            str(ck),
            "--ds-checkpoint",
            str(tmp_path / "ck"),
            "--output-dir",
            str(tmp_path / "b"),
            *extra,
        ]
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        assert all(w in lines[0] for w in words + ["--allow-resume-change"]), lines[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_periodic_checkpoints_keep_the_newest(tmp_path):
    cfg = _config(tmp_path, "tiny_llama_cpu.json")
    ck = tmp_path / "ck"
    _ok(
        _run(
            _cmd(
                cfg,
                "tiny-llama",
                tmp_path / "a",
                "--steps",
                "7",
                "--save-interval",
                "2",
                "--keep-checkpoints",
                "2",
                "--ds-checkpoint",
                str(ck),
            )
        )
    )
    tags = sorted(t for t in os.listdir(ck) if t.startswith("global_step"))
    assert tags == ["global_step6", "global_step7"], tags  # 2, 4, 6 periodic + 7 at the end; newest 2 kept
    assert (ck / "latest").read_text() == "global_step7"
    assert not [t for t in os.listdir(ck) if t.startswith(".tmp-")]
    for tag in tags:
        state = json.loads((ck / tag / "dhelix_run_state.json").read_text())
        assert state["step"] == int(tag.removeprefix("global_step")) and state["total_steps"] == 7
        assert len(glob.glob(str(ck / tag / "dhelix_rng_rank*.pt"))) == 2


def _start(cmd) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _ranks(proc, timeout=60.0) -> list:
    """The rank processes under a launcher, rank 0 first, once both run."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = [k for k in psutil.Process(proc.pid).children(recursive=True) if "--local_rank" in " ".join(k.cmdline())]
        if len(kids) == 2:
            return sorted(kids, key=lambda k: " ".join(k.cmdline()))
        time.sleep(0.5)
    raise AssertionError("the ranks did not start")


class _Stderr:
    """The launcher's stderr, read by a thread (so the test can wait for training to be under
    way instead of sleeping a fixed time); ``text()`` once the process is done."""

    def __init__(self, proc):
        import threading

        self.chunks, self.thread = [], threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self.thread.start()
        # stdout drained too, so a full pipe never blocks the launcher
        threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()

    def _read(self, stream):
        for chunk in iter(lambda: stream.read(256), ""):
            self.chunks.append(chunk)

    def wait_for_step(self, step: int, timeout: float = 120.0) -> None:
        """Until rank 0's progress bar shows ``step`` steps done (the bar's "n/total")."""
        import re

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [int(n) for n in re.findall(r"\b(\d+)/100000\b", "".join(self.chunks[-50:]))]
            if done and max(done) >= step:
                return
            time.sleep(0.2)
        raise AssertionError(f"no step {step} within {timeout:.0f} s: " + "".join(self.chunks)[-2000:])

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "".join(self.chunks)


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_to_the_launcher_stops_every_rank_and_saves(tmp_path):
    import psutil

    cfg = _config(tmp_path, "tiny_llama_cpu.json", scheduler=False)  # constant LR: any length resumes alike
    ck = tmp_path / "ck"
    proc = _start(
        _cmd(cfg, "tiny-llama", tmp_path / "a", "--steps", "100000", "--ds-checkpoint", str(ck), "--save-on-signal")
    )
    try:
        ranks, stderr = _ranks(proc), _Stderr(proc)
        stderr.wait_for_step(3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the launcher only: DeepSpeed's runner forwards nothing
        gone, alive = psutil.wait_procs(ranks, timeout=20)
        assert not alive, f"ranks still running {time.monotonic() - t0:.0f} s after SIGTERM"
        proc.wait(timeout=30)
        err = stderr.text()
    finally:
        _kill_group(proc)
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("train.py: stopped by")]
    assert len(lines) == 1 and "checkpoint saved" in lines[0], err[-2000:]
    step = int((ck / "latest").read_text().removeprefix("global_step"))
    assert step >= 1
    # the saved checkpoint resumes to what an uninterrupted run of step + 2 steps gives
    _ok(
        _run(
            _cmd(
                cfg,
                "tiny-llama",
                tmp_path / "b",
                "--steps",
                str(step + 2),
                "--resume",
                str(ck),
                "--allow-resume-change",
                "--ds-checkpoint",
                str(ck),
                "--json-summary",
                str(tmp_path / "b.json"),
            )
        )
    )
    _ok(
        _run(
            _cmd(
                cfg,
                "tiny-llama",
                tmp_path / "full",
                "--steps",
                str(step + 2),
                "--json-summary",
                str(tmp_path / "full.json"),
            )
        )
    )
    assert _summary(tmp_path / "b.json")["losses"] == _summary(tmp_path / "full.json")["losses"][step:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_of_one_rank_ends_the_other_with_one_line(tmp_path):
    import psutil

    cfg = _config(tmp_path, "tiny_llama_cpu.json")
    proc = _start(_cmd(cfg, "tiny-llama", tmp_path / "a", "--steps", "100000"))
    try:
        (rank0, rank1), stderr = _ranks(proc), _Stderr(proc)
        stderr.wait_for_step(2)
        t0 = time.monotonic()
        rank1.kill()
        gone, alive = psutil.wait_procs([rank0], timeout=15)
        assert not alive, "rank 0 still running 15 s after its peer died"
        proc.wait(timeout=30)
        err = stderr.text()
    finally:
        _kill_group(proc)
    assert time.monotonic() - t0 < 45 and proc.returncode != 0
    lines = [line for line in err.splitlines() if "train.py: error: rank 0:" in line]
    assert len(lines) == 1, err[-3000:]
    assert "collective" in lines[0] and "peer rank 1" in lines[0] and "step" in lines[0], lines[0]


@pytest.mark.timeout(120)
def test_failed_export_keeps_the_previous_one_and_no_temporary_folder(tmp_path, monkeypatch):
    from ds_dhelix.engine import checkpoint
    from ds_dhelix.engine.checkpoint import EXPORT_MARK, export_hf
    from hf_models.registry import build_model

    model, _ = build_model("tiny-llama", seed=0)
    out = tmp_path / "hf"
    export_hf(model, str(out))
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    assert EXPORT_MARK in before

    calls = []
    add = checkpoint.ShardWriter.add

    def broken(self, key, tensor):  # the disk fills up after a few tensors, mid-file
        calls.append(key)
        if len(calls) > 5:
            raise OSError("disk full")
        add(self, key, tensor)

    monkeypatch.setattr(checkpoint.ShardWriter, "add", broken)
    with pytest.raises(OSError, match="disk full"):
        export_hf(model, str(out), max_shard_size="100KB")  # several files: the failure comes mid-export
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-hf")] == []


def test_export_without_atomic_exchange_puts_the_previous_one_back_on_failure(tmp_path, monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) is missing, publish_dir renames twice; a failure of the
    second rename restores the previous directory."""
    from ds_dhelix.engine import checkpoint

    target, new = tmp_path / "hf", tmp_path / ".tmp-hf-new"
    target.mkdir()
    (target / "a").write_text("old")
    new.mkdir()
    (new / "a").write_text("new")
    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("no space left")
        real(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", rename)
    with pytest.raises(OSError, match="no space"):
        checkpoint.publish_dir(str(new), str(target))
    assert (target / "a").read_text() == "old" and len(calls) == 3  # moved aside, failed, put back
    monkeypatch.setattr(checkpoint.os, "rename", real)
    checkpoint.publish_dir(str(new), str(target))
    assert (target / "a").read_text() == "new" and not new.exists()
    assert [p for p in os.listdir(tmp_path) if p.endswith(".old")] == []


def test_atomic_exchange_swaps_directories(tmp_path):
    from ds_dhelix.engine.checkpoint import _exchange_for_test, publish_dir

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "f").write_text("a")
    (b / "f").write_text("b")
    if not _exchange_for_test(str(a), str(b)):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    assert (a / "f").read_text() == "b" and (b / "f").read_text() == "a"
    publish_dir(str(a), str(b))  # b gets a's content (now "b"), a's directory is gone
    assert (b / "f").read_text() == "b" and not a.exists()
