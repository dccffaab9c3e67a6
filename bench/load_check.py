"""What `pdserve bench load --http` counts as served, and its verdict.

A 200 is ``done`` only when its body is a well-formed OpenAI ``text_completion`` carrying
exactly the tokens the bench asked for: every request sets ``ignore_eos``, so the model cannot
stop early and ``usage.completion_tokens`` must equal ``max_tokens`` with ``finish_reason``
"length". Anything else is a ``bad_200``: a front door that answers 200 without serving is
not serving.

The verdict (``checks``, all must hold for ``passed``):

    errors            0 at both levels: every request answered, 200, 413 or 429
    bad_200           0 at both levels
    within_bound      the router's peak RSS under --rss-bound-mb
    done_ratio_vs_1x  done/s at --overload at least DONE_RATIO_MIN x done/s at 1x, the
                      reference level run first against the same router: refusing the excess
                      must not cost the admitted work its throughput (a router that answers 429
                      to everything under overload, or to everything at all, fails here)
"""
from __future__ import annotations

import json

MAX_TOKENS = 4  # output tokens every request asks for (the point is the front door, not decoding)

# Overload may cost the admitted requests some throughput: the router parses and refuses the
# excess on the same cores (on the 2-core dev VM the load process shares them too). A fifth is
# the most we accept; a router that sheds by refusing everything loses all of it.
DONE_RATIO_MIN = 0.8


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def check_completion(body: bytes | None, max_tokens: int) -> str | None:
    """Why a 200's body is not a completion of ``max_tokens`` tokens (one choice, ignore_eos);
    None when it is one."""
    try:
        doc = json.loads(body or b"")
    except (ValueError, UnicodeDecodeError):
        return "the body is not JSON"
    if not isinstance(doc, dict):
        return "the body is not a JSON object"
    if doc.get("object") != "text_completion":
        return f"object is {str(doc.get('object'))[:40]!r}, not 'text_completion'"
    if not isinstance(doc.get("id"), str) or not doc["id"] or not isinstance(doc.get("model"), str):
        return "no id or model"
    choices = doc.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return "not exactly one choice"
    choice = choices[0]
    if choice.get("index") != 0 or not isinstance(choice.get("text"), str):
        return "the choice has no index 0 or no text"
    usage = doc.get("usage")
    if not isinstance(usage, dict) or not all(_count(usage.get(k)) for k in
                                              ("prompt_tokens", "completion_tokens", "total_tokens")):
        return "no usage counts"
    if usage["completion_tokens"] != max_tokens:
        return f"{usage['completion_tokens']} completion tokens, {max_tokens} asked for (ignore_eos)"
    if choice.get("finish_reason") != "length":
        return f"finish_reason {str(choice.get('finish_reason'))[:40]!r}, not 'length' (ignore_eos)"
    if usage["prompt_tokens"] < 1 or usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return "usage counts do not add up"
    return None


def level_figures(out: dict, clients: int, seconds: float) -> dict:
    """One level's figures from the load process's JSON line."""
    status = {int(k): v for k, v in out["status"].items()}
    bad = out["bad_200"]
    return {
        "clients": clients, "requests": out["requests"], "answered": sum(status.values()),
        "done": status.get(200, 0) - bad, "bad_200": bad, "rejected_429": status.get(429, 0),
        "too_large_413": status.get(413, 0),
        "errors": out["lost"] + sum(v for k, v in status.items() if k not in (200, 413, 429)),
        "status": {str(k): v for k, v in sorted(status.items())},
        "done_per_s": round(out["done_in_window"] / seconds, 3),
    }


def verdict(at_1x: dict, at_overload: dict, within_bound: bool, done_ratio_min: float = DONE_RATIO_MIN) -> dict:
    """The ratio of the two levels' done rates and the checks (module docstring). A smoke run of
    a few seconds on a busy machine passes ``done_ratio_min=0``: a rate is a benchmark's figure,
    never a test's assertion; the ratio is still computed and reported."""
    rate, rate_1x = at_overload["done_per_s"], at_1x["done_per_s"]
    ratio = rate / rate_1x if rate_1x > 0 else None  # nothing served at 1x: no reference, a failure
    checks = {
        "errors": at_1x["errors"] == 0 and at_overload["errors"] == 0,
        "bad_200": at_1x["bad_200"] == 0 and at_overload["bad_200"] == 0,
        "within_bound": within_bound,
        "done_ratio_vs_1x": ratio is not None and ratio >= done_ratio_min,
    }
    return {"done_per_s": rate, "done_per_s_at_1x": rate_1x,
            "done_ratio_vs_1x": None if ratio is None else round(ratio, 3), "done_ratio_min": done_ratio_min,
            "checks": checks, "passed": all(checks.values())}
