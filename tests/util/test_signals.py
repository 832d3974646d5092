"""SIGINT and SIGTERM, sent for real to the `prequant` command at several moments (its imports, a conversion's
start-up, verify's hashing, an upload waiting on the Hub): exit status 130 / 143, one line on stderr, always."""
# ruff: noqa: F811 - test parameters named after the imported `hub_server` fixture

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import start_cli
from hub_server import TOKEN, HubServer, hub_server  # noqa: F401 - the fixture

SIGNALS = [signal.SIGINT, signal.SIGTERM]


def _handling_signals(pid: int) -> bool:
    """Whether the process catches SIGTERM (Python never does on its own: prequant's handler is installed)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _started(*args: str, env: dict | None = None):
    """The CLI, once it handles signals (its first line; before it, the interpreter's own start-up, where Python's
    defaults apply), or after 2 s (well past its first line, however loaded the machine)."""
    proc = start_cli(*args, env=env)
    deadline = time.monotonic() + 2
    while not _handling_signals(proc.pid) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    return proc


def _interrupted(proc, sig: int, *, send: bool = True) -> str:
    """Send `sig` (unless the process sends it itself), wait; check the exit status and the one stderr line."""
    if send:
        assert proc.poll() is None, "finished before the signal was sent: nothing was tested"
        proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: interrupted by {signal.Signals(sig).name}"), stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("delay", [0.0, 0.2, 0.6, 1.2])
def test_convert_start_up(checkpoints, tmp_path, sig, delay):
    """During the imports of typer, torch and transformers and the planning: nothing written yet."""
    proc = _started("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu")
    time.sleep(delay)
    _interrupted(proc, sig)
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_verify_start_up(converted_llama, sig):
    proc = _started("verify", str(converted_llama[1]))
    time.sleep(0.3)
    _interrupted(proc, sig)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_verify_hashing(converted_llama, sig):
    """Between two files' sha256 (PREQUANT_FAILPOINT sends the signal from verify itself, at that very point)."""
    env = {"PREQUANT_FAILPOINT": f"verify-hashed:2:{signal.Signals(sig).name}"}
    proc = start_cli("verify", str(converted_llama[1]), env=env)
    _interrupted(proc, sig, send=False)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_upload_waiting_on_the_hub(hub_server: HubServer, monkeypatch, carded_converted: Path, sig):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    stall = hub_server.stall("preupload")  # the Hub takes its time answering, as it does with big commits
    proc = _started("upload", str(carded_converted), "me/tiny-nf4")
    try:
        assert stall.arrived.wait(120), proc.communicate()
        _interrupted(proc, sig)
    finally:
        stall.release.set()
    assert not hub_server.has_repo("me/tiny-nf4") or "prequant.json" not in hub_server.files("me/tiny-nf4")


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_conversion_pipeline(checkpoints, tmp_path, sig):
    """Inside the pipeline (the writer thread sends it after a tensor): the resume hint comes with the line."""
    env = {"PREQUANT_FAILPOINT": f"step-journaled:2:{signal.Signals(sig).name}"}
    proc = start_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu", env=env)
    said = _interrupted(proc, sig, send=False)
    assert "run the same command again to continue" in said and "--resume" not in said  # as README says


def test_a_swallowed_signal_still_ends_the_command_with_its_status():
    """A library that catches everything (here `except BaseException: pass` around the signal's arrival)
    cannot turn SIGTERM into exit status 0: the command ends with 143 and the one line."""
    code = textwrap.dedent("""
        import os, signal, types
        from prequant import __main__ as entry, cli
        from prequant.util import signals

        def main():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except BaseException:
                pass

        signals.install()
        entry._run(types.SimpleNamespace(main=main, interrupted=cli.interrupted))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 143, done.stderr
    assert done.stderr.strip() == "Error: interrupted by SIGTERM"


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          check=False)


def test_a_signal_inside_a_deferred_import_is_raised_when_the_import_is_done():
    """Inside `deferred()` (around torch's and bitsandbytes' imports) the handler only records the signal: the
    import runs to its end, where the signal is raised, never from inside a compiled module's callback."""
    done = _run_python("""
        import os, signal
        from prequant.util import signals

        signals.install()
        try:
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                import json  # the rest of the import still runs
                print("inside, after the signal", flush=True)
            print("not reached")
        except signals.Signalled as e:
            print("raised after the block:", signals.name(e.signum))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["inside, after the signal", "raised after the block: SIGINT"]


def test_a_second_signal_inside_a_deferred_import_ends_the_process_at_once():
    done = _run_python("""
        import os, signal
        from prequant.util import signals

        signals.install()
        with signals.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            print("not reached", flush=True)
    """)
    assert done.returncode == 143 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.strip() == "Error: interrupted by SIGTERM"


def test_another_threads_deferred_import_leaves_the_main_threads_signals_alone():
    """bitsandbytes imports on a thread of its own while the pipeline runs (`bnb.starting`): a signal then still
    stops the main thread at once, and nothing is raised in the importing thread."""
    done = _run_python("""
        import os, signal, threading
        from prequant.util import signals

        signals.install()
        inside, release, seen = threading.Event(), threading.Event(), []

        def importer():
            try:
                with signals.deferred():
                    inside.set()
                    release.wait()
                seen.append("importer done")
            except BaseException as e:
                seen.append(f"importer raised {type(e).__name__}")

        t = threading.Thread(target=importer)
        t.start()
        inside.wait()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            print("not reached", flush=True)
        except signals.Signalled as e:
            print("main raised:", signals.name(e.signum))
        release.set()
        t.join()
        print(*seen)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["main raised: SIGINT", "importer done"]
