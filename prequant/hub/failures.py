"""Hub failures as one message line each: what failed, why, and what to do; tokens never appear in it.

Knows huggingface_hub's errors and the transport errors of whichever HTTP client it has loaded, and sorts the
passing ones (`is_transient`) from those a retry cannot mend.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import sys
import traceback
import urllib.error
from pathlib import Path

from huggingface_hub import constants
from huggingface_hub import errors as hf_errors
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .. import settings

_NETWORK_FIX = "check the network or HF_ENDPOINT, or download the repo and pass its local directory"
_LOGIN_FIX = "set HF_TOKEN or run `hf auth login`"


# A missing file on the Hub (huggingface_hub < 1.0 had no Remote- prefix and no Local/Remote split).
RemoteEntryNotFound = getattr(hf_errors, "RemoteEntryNotFoundError", None) or hf_errors.EntryNotFoundError


RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# getaddrinfo's answers for a host name that does not resolve (EAI_NODATA is not defined everywhere); its others,
# EAI_AGAIN ("Temporary failure in name resolution") first, may pass.
_NAME_UNKNOWN = frozenset(getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name))


class IncompleteDownload(Exception):
    """The file on disk does not have the size the Hub lists."""


def is_incomplete(error: BaseException) -> bool:
    """Ours, or huggingface_hub's own size check after a body that ended early."""
    return isinstance(error, IncompleteDownload) or (
        isinstance(error, OSError) and "Consistency check failed" in str(error)
    )


def is_transient(error: BaseException) -> bool:
    """Whether trying again may succeed: a connection refused, reset, cut or timed out, an answer 408, 429 or 5xx,
    a body that ended short. Never a missing repo, revision or file, a refused token, or a local failure (a full
    disk), nor a host name that does not resolve: no network, or a wrong HF_ENDPOINT, neither of which passes in
    seconds; a name server that does not answer for now (EAI_AGAIN) may. The first error of the chain that says
    either way decides (huggingface_hub wraps the network's)."""
    if any(isinstance(e, socket.gaierror) and e.errno in _NAME_UNKNOWN for e in _chain(error)):
        return False
    for e in _chain(error):
        if isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, OfflineModeIsEnabled)):
            return False
        if _from_xet(e) and (status := _xet_status(e)) is not None:
            return status in RETRY_STATUSES
        if isinstance(e, RemoteEntryNotFound) and not isinstance(e, LocalEntryNotFoundError):
            return False
        status = _status(e)
        if status is not None:
            return status in RETRY_STATUSES
        if isinstance(e, socket.gaierror) and e.errno == socket.EAI_AGAIN:
            return True
        if is_incomplete(e) or isinstance(e, _passing_network_error_types()):
            return True
    return False


def _status(error: BaseException) -> int | None:
    """The HTTP status of an error answer (huggingface_hub's, or the standard library's), else None."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        return error.response.status_code
    return None


def explain(
    error: BaseException,
    action: str,
    repo_id: str,
    revision: str | None,
    token: str | None,
    *,
    endpoint: str,
    writing: bool = False,
) -> str:
    """One line: what failed, why, and what to do (`endpoint`: the Hub the request went to)."""
    # huggingface_hub wraps some HTTP errors (e.g. a failed HEAD becomes LocalEntryNotFoundError): use the HTTP one.
    error = next((e for e in _chain(error) if isinstance(e, HfHubHTTPError)), error)
    secrets = _known_tokens(token)
    reason = short(error, token)
    status = _status(error) or getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, GatedRepoError):
        return (
            f"cannot {action}: {repo_id} is a gated repo; accept its conditions at {endpoint}/{repo_id}, "
            f"then {_LOGIN_FIX} with that account"
        )
    if isinstance(error, RepositoryNotFoundError):
        if secrets:
            return (
                f"cannot {action}: repository {repo_id} was not found on {endpoint}, or your token has no "
                "access to it; check the name and the token (HF_TOKEN or `hf auth login`)"
            )
        return (
            f"cannot {action}: repository {repo_id} was not found on {endpoint}; check the name, or if it is "
            f"private {_LOGIN_FIX}"
        )
    if isinstance(error, RevisionNotFoundError):
        return (
            f"cannot {action}: revision '{revision}' does not exist in {repo_id}; pass an existing branch, "
            "tag or full commit sha as org/name@revision"
        )
    if isinstance(error, RemoteEntryNotFound) and not isinstance(error, LocalEntryNotFoundError):
        return f"cannot {action}: the file does not exist at that commit ({reason})"
    if isinstance(error, OfflineModeIsEnabled):
        return f"cannot {action}: offline mode is enabled (HF_HUB_OFFLINE); unset it, or pass a local directory"
    if status == 401:
        fix = "set a valid HF_TOKEN or run `hf auth login`" if secrets else _LOGIN_FIX
        return f"cannot {action}: the Hub at {endpoint} refused the credentials (401: {reason}); {fix}"
    if status == 403:
        need = "write access to" if writing else "access to"
        return f"cannot {action}: the token lacks {need} {repo_id} (403); use a token with that permission"
    if any(_from_xet(e) for e in _chain(error)):
        return (f"cannot {action}: the Hub's Xet storage failed ({reason}); try again later, or set "
                "HF_HUB_DISABLE_XET=1 to send the files through LFS instead")
    if isinstance(error, HfHubHTTPError):
        return f"cannot {action}: the Hub at {endpoint} answered {status or 'an error'} ({reason}); try again later"
    if isinstance(error, urllib.error.HTTPError):
        return f"cannot {action}: the server at {_origin(error.url)} answered {status} ({reason}); try again later"
    if is_incomplete(error):
        return f"cannot {action}: the file is incomplete ({reason}); run again, or check the disk and the network"
    if any(isinstance(e, json.JSONDecodeError) for e in _chain(error)):
        return f"cannot {action}: {endpoint} did not answer like a Hugging Face Hub ({reason}); check HF_ENDPOINT"
    if _is_network_error(error):
        fix = "check the network or HF_ENDPOINT" if writing else _NETWORK_FIX
        return f"cannot reach the Hugging Face Hub at {endpoint} to {action}: {short(_root(error), token)}; {fix}"
    return f"cannot {action}: {type(error).__name__}: {reason}"


def _from_xet(error: BaseException) -> bool:
    """Whether `error` came out of huggingface_hub's Xet transfer (hf_xet raises plain ConnectionErrors and
    RuntimeErrors, so where it was raised says it)."""
    return type(error).__module__.startswith("hf_xet") or any(
        "xet" in frame.f_code.co_name or "hf_xet" in frame.f_code.co_filename
        for frame, _ in traceback.walk_tb(error.__traceback__)
    )


def _xet_status(error: BaseException) -> int | None:
    """The HTTP status an Xet error's message names ("... (501 Not Implemented) ..."), else None."""
    match = re.search(r"\((\d{3}) [A-Z][^)]*\)", str(error))
    return int(match.group(1)) if match else None


def _network_error_types() -> tuple[type[BaseException], ...]:
    """Transport failures of whichever HTTP client huggingface_hub has loaded (httpx2, httpx or requests)."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, urllib.error.URLError, http.client.HTTPException]
    for module, name in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "ConnectionError"),
        ("requests", "Timeout"),
    ):
        loaded = sys.modules.get(module)  # never import a client just to name its errors
        if loaded is not None and isinstance(getattr(loaded, name, None), type):
            types.append(getattr(loaded, name))
    return tuple(types)


def _passing_network_error_types() -> tuple[type[BaseException], ...]:
    """Transport failures that may pass: refused, reset or cut connections and timeouts (huggingface_hub retries the
    same classes of its HTTP client), not a malformed URL or an unsupported scheme."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, http.client.HTTPException]
    for module, names in (
        ("httpx2", ("TimeoutException", "NetworkError", "RemoteProtocolError")),
        ("httpx", ("TimeoutException", "NetworkError", "RemoteProtocolError")),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        loaded = sys.modules.get(module)
        for name in names:
            if loaded is not None and isinstance(getattr(loaded, name, None), type):
                types.append(getattr(loaded, name))
    return tuple(types)


def _is_network_error(error: BaseException) -> bool:
    return any(isinstance(e, _network_error_types()) for e in _chain(error))


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        reason = getattr(current, "reason", None) if isinstance(current, urllib.error.URLError) else None
        current = reason if isinstance(reason, BaseException) else current.__cause__ or current.__context__
    return seen


def _root(error: BaseException) -> BaseException:
    """The innermost network error behind a wrapped one (the useful "why")."""
    network = [e for e in _chain(error) if isinstance(e, _network_error_types())]
    return network[-1] if network else error


def _origin(url: str | None) -> str:
    """scheme://host of a URL, without its path and query (a signed CDN URL's query is a credential)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url or "")
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else "the CDN"


def short(error: BaseException, token: str | None) -> str:
    """The error's reason as a short line, without any token."""
    text = first_line(getattr(error, "server_message", None) or str(error)) or type(error).__name__
    for secret in _known_tokens(token):
        text = text.replace(secret, "***")
    return text[:300]


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _known_tokens(token: str | None) -> list[str]:
    """Tokens this process may send, so that messages can be scrubbed of them."""
    candidates = [token, *settings.hf_tokens()]
    try:
        candidates.append(Path(constants.HF_TOKEN_PATH).read_text().strip())
    except OSError:
        pass
    return [t for t in candidates if t and len(t) >= 8]


__all__ = ["RETRY_STATUSES", "IncompleteDownload", "explain", "first_line", "is_transient", "short"]
