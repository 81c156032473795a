"""Whether the Hugging Face hub can be asked, known within seconds.

Asked a hub that cannot be reached, huggingface_hub retries for about 40 s
and then fails with a traceback, and it waits without end on one that
accepts a connection but never answers. Before a RAM merge asks the hub
anything (a hub id to download, the model card's lookup of a local folder
named like a hub id), it asks once whether the hub answers at all: one HEAD
request through huggingface_hub's own client (its proxies and certificates),
for at most HF_HUB_ETAG_TIMEOUT seconds, remembered for the process.
"""

from __future__ import annotations

import threading
from functools import cache

from huggingface_hub import constants, get_session
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id


def is_repo_id(path: str) -> bool:
    """Whether `path` is spelled like a hub id (`org/name`, `name`)."""
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def hub_reachable() -> bool:
    """False with HF_HUB_OFFLINE=1 (nothing is sent) or when the hub does
    not answer within HF_HUB_ETAG_TIMEOUT seconds."""
    if constants.HF_HUB_OFFLINE:
        return False
    return _answers(constants.ENDPOINT, constants.HF_HUB_ETAG_TIMEOUT)


def silent_hub() -> str:
    """Why the hub cannot be asked, for a message (hub_reachable() is False)."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1 is set"
    seconds = constants.HF_HUB_ETAG_TIMEOUT
    return f"the hub at {constants.ENDPOINT} did not answer within {seconds} s"


@cache
def _answers(endpoint: str, seconds: float) -> bool:
    """One HEAD request; any HTTP response counts. A thread bounds the wait,
    name resolution included, which the client's own timeout does not."""
    done = threading.Event()
    answers: list[bool] = []

    def ask() -> None:
        try:
            get_session().head(endpoint, timeout=seconds)
            answers.append(True)
        except Exception:  # refused, unresolvable, TLS, timeout: no answer
            pass
        finally:
            done.set()

    threading.Thread(target=ask, name="mergekit-ram hub check", daemon=True).start()
    done.wait(seconds)
    return bool(answers)
