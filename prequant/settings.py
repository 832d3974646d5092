"""Every environment variable prequant reads, in one place (documented in docs/environment.md).

Each is read when asked, not at import, so that a test or a long-lived process that changes the environment is
heard. A value that cannot be parsed falls back to the default with a warning on stderr, never stops a conversion:
a typo in a shell profile must not cost an hour of work. Standard library only: the CLI imports this before torch.

The Hugging Face variables (HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_HUB_ENABLE_HF_TRANSFER, ...) are huggingface_hub's own, read by it.
"""

from __future__ import annotations

import os
import sys

DEBUG = "PREQUANT_DEBUG"
PROGRESS = "PREQUANT_PROGRESS"
PROGRESS_INTERVAL = "PREQUANT_PROGRESS_INTERVAL"
HUB_RETRY_S = "PREQUANT_HUB_RETRY_S"
CUDA_MEMORY_LIMIT = "PREQUANT_CUDA_MEMORY_LIMIT"
TRACE = "PREQUANT_TRACE"
FAILPOINT = "PREQUANT_FAILPOINT"

# Passing Hub failures (connection resets, timeouts, 408/429/5xx) are retried for this long, in doubling waits: a
# Hub incident or a load balancer's restart lasts tens of seconds, and a rerun of a 600 GB conversion costs more.
HUB_RETRY_DEFAULT_S = 120.0
PROGRESS_FORMS = ("auto", "bar", "lines", "json", "none")
PROGRESS_INTERVAL_DEFAULT_S = 10.0


def debug() -> bool:
    """PREQUANT_DEBUG set (to anything but empty or 0): errors show their traceback after the one-line message."""
    return os.environ.get(DEBUG, "").strip() not in ("", "0")


def progress() -> str:
    """PREQUANT_PROGRESS: `auto` (a bar on a terminal, a status line every interval otherwise), `bar`, `lines`,
    `json` (one record per line, for CI logs) or `none`."""
    value = os.environ.get(PROGRESS, "auto").strip().lower() or "auto"
    if value in ("off", "0"):
        return "none"
    if value not in PROGRESS_FORMS:
        _unknown(PROGRESS, value, "auto")
        return "auto"
    return value


def progress_interval() -> float:
    """PREQUANT_PROGRESS_INTERVAL: seconds between status lines or records off a terminal."""
    return _number(PROGRESS_INTERVAL, PROGRESS_INTERVAL_DEFAULT_S)


def hub_retry_s() -> float:
    """PREQUANT_HUB_RETRY_S: how long passing Hub failures are retried (0 tries once)."""
    return max(0.0, _number(HUB_RETRY_S, HUB_RETRY_DEFAULT_S))


def cuda_memory_limit() -> str | None:
    """PREQUANT_CUDA_MEMORY_LIMIT: a cap on what torch may allocate on the GPU ("8GiB", "8000MB", bytes), to prove
    a conversion fits a smaller GPU; parsed by `bnb.quantize`, which refuses a value it cannot read."""
    return os.environ.get(CUDA_MEMORY_LIMIT, "").strip() or None


def trace_path() -> str | None:
    """PREQUANT_TRACE=FILE: write the run's timeline (named events, busy time per stage) there at exit."""
    return os.environ.get(TRACE) or None


def failpoint() -> str:
    """PREQUANT_FAILPOINT=name:n[:ACTION]: the kill-and-resume tests' crash point (never set in normal use)."""
    return os.environ.get(FAILPOINT, "")


def _number(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        _unknown(name, text, default)
        return default


# The values warned about already: a setting is read wherever it is needed, its warning is said once a process.
_warned: set[tuple[str, str]] = set()


def _unknown(name: str, value: str, default: object) -> None:
    if (name, value) not in _warned:
        _warned.add((name, value))
        print(f"prequant: warning: {name}={value!r} is not understood; using {default}", file=sys.stderr)


# Other tools' variables that prequant must see as they do. huggingface_hub reads its own at import; these are read
# when asked, so that a process that sets them later (a test, a notebook) is heard.


def hf_endpoint() -> str | None:
    """HF_ENDPOINT: the Hub's URL (None: huggingface_hub's default)."""
    return os.environ.get("HF_ENDPOINT") or None


def hf_cache_dir() -> str:
    """The Hugging Face hub cache, as huggingface_hub resolves it: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub (~/.cache when unset)."""
    env = os.environ
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = env.get("HF_HOME") or os.path.join(xdg, "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(cache))


def hf_offline() -> bool | None:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it; None when neither is set."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return None if value is None else value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hf_tokens() -> list[str]:
    """The tokens set in the environment (HF_TOKEN, HUGGING_FACE_HUB_TOKEN), so messages can be scrubbed of them."""
    return [t for t in (os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")) if t]


LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def missing_launcher() -> list[str]:
    """The variables a launcher (torchrun, `accelerate launch`) exports to every rank that this process lacks."""
    return [k for k in LAUNCHER if k not in os.environ]


def world_size() -> int:
    """WORLD_SIZE as the launcher set it (1 without one): there may be no process group yet."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def accelerate_fsdp(name: str) -> str | None:
    """accelerate's FSDP_* variable `name` (what `accelerate launch --fsdp_*` exports), None when unset."""
    return os.environ.get(name)
