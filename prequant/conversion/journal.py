"""The resume journal: what an interrupted conversion had finished, and for which job.

It lives in the staging folder next to the partial shards. `job.json` fingerprints the job (source files, the whole
plan, prequant's version): the same job run again continues from the journal (`output.claim` refuses another job's).
`journal.jsonl` gets one line per finished tensor (with its quant-state JSON, the only bytes the shard header still
needs), one per finished shard, and one per Hub shard this run downloaded (a resume deletes it in its turn with
--delete-source-shards, rather than taking it for one the user had cached). A tensor is journaled only after its
bytes are in the shard file, so after any kill every journaled tensor is on disk (in the page cache at least;
shards are fsynced when finished).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..util.fsio import write_error, write_json

if TYPE_CHECKING:
    from .plan import Plan

JOB = "job.json"
JOURNAL = "journal.jsonl"


def fingerprint(plan: Plan, source_files: tuple[Path, ...], version: str) -> dict:
    """What must not change between an interrupted run and the run that continues it."""
    files = []
    for p in source_files:
        st = p.stat()
        files.append({"name": p.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    plan_hash = hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()
    return {"prequant": version, "source_files": files, "plan_sha256": plan_hash}


def job_id(job: dict) -> str:
    """A job's fingerprint as one string, which the manifest records (a rerun then knows a finished job)."""
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()


@dataclass
class Finished:
    """What the journal says is finished."""

    steps: dict[str, dict[str, bytes]] = field(default_factory=dict)  # source name -> variable-size blobs
    shards: set[str] = field(default_factory=set)
    non_finite: dict[str, tuple[int, int]] = field(default_factory=dict)  # kept tensor -> (NaN, Inf) counts
    downloaded: set[str] = field(default_factory=set)  # Hub shards the interrupted run downloaded (to delete)


class Journal:
    """Append-only record of finished work; thread-safe enough for the single writer thread that uses it."""

    def __init__(self, staging: Path, job: dict) -> None:
        """Continue the journal in `staging` when it holds this `job` (`output.claim` let no other job's stay),
        else start one."""
        self.staging = staging
        self.done = Finished()
        if (staging / JOB).exists():
            self.done = _read(staging / JOURNAL)
        else:
            write_json(staging / JOB, job)
            (staging / JOURNAL).unlink(missing_ok=True)
        self._file = open(staging / JOURNAL, "a")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()  # the writer's lines, and the download thread's (`source_downloaded`)

    @property
    def resumed(self) -> bool:
        return bool(self.done.steps)

    def step_done(self, name: str, blobs: dict[str, bytes], non_finite: tuple[int, int] | None = None) -> None:
        """Tensor `name` is in its shard file: its variable-size `blobs` and, for a kept one, its NaN and Inf."""
        record: dict = {"step": name, "blobs": {k: base64.b64encode(v).decode() for k, v in blobs.items()}}
        if non_finite:
            record["non_finite"] = list(non_finite)
        self._append(record)

    def shard_done(self, shard: str) -> None:
        """Shard `shard` is finished and fsynced."""
        self._append({"shard": shard})

    def source_downloaded(self, name: str) -> None:
        """A Hub source's shard `name` was downloaded by this run, which deletes it once converted."""
        self._append({"downloaded": name})

    def _append(self, record: dict) -> None:
        try:
            with self._lock:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()  # into the kernel: survives SIGKILL of this process
        except OSError as e:  # a full disk or quota: the journal's last line may be cut, which _read allows
            raise write_error(self.staging / JOURNAL, e) from e

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # the line that could not be flushed has already been reported (or the run is being stopped)


def _read(path: Path) -> Finished:
    """What the journal at `path` says is finished, up to its first line cut short."""
    done = Finished()
    if not path.exists():
        return done
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            break  # a line cut short by the kill: everything after it is unknown
        if "step" in record:
            done.steps[record["step"]] = {k: base64.b64decode(v) for k, v in record["blobs"].items()}
            if "non_finite" in record:
                done.non_finite[record["step"]] = tuple(record["non_finite"])  # type: ignore[assignment]
        elif "shard" in record:
            done.shards.add(record["shard"])
        elif "downloaded" in record:
            done.downloaded.add(record["downloaded"])
    return done

