"""Settings that more than one role has, declared once: each role's config names the field the
same and takes its declaration from here (the flag, its default, its unit), with a help text
that says what that role does with it."""
from __future__ import annotations

from typing import Any

from settings.flags import setting

DRAIN_TIMEOUT_S = 30.0


def drain_timeout(what: str) -> Any:
    """``--drain-timeout``: seconds in-flight requests may take to finish once a process is
    told to stop (SIGTERM, Ctrl-C, a scale-down), new ones refused meanwhile: the router's
    (RouterConfig), a node's (NodeConfig, `pdserve nodes`), the whole local cluster's
    (ClusterConfig, `pdserve up`: the router's drain, then the nodes stop). ``what``: the help."""
    return setting(DRAIN_TIMEOUT_S, flag="--drain-timeout", help=what)
