"""settings/flags.py: flags generated from field declarations, and back (``to_argv``)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from settings.flags import add_arguments, from_args, negated, negative_is_none, setting, to_argv


@dataclasses.dataclass(frozen=True)
class Tiny:
    name: str = setting(flag="--name")  # no default: a required flag
    count: int = setting(3, flag="--count")
    ratio: float | None = setting(None, flag="--ratio")
    port: int | None = setting(80, flag="--port", to_field=negative_is_none)
    verbose: bool = setting(False, flag="--verbose")
    fetch: bool = setting(True, flag="--no-fetch")
    caching: bool = setting(True, flag="--no-caching", dest="no_caching", flag_default=False, action="store_true",
                            to_field=negated)
    threads: int | None = setting(None, flag="--threads", dest="num_threads")
    tags: tuple[str, ...] = setting((), flag="--tag", flag_default=[], action="append", type=None, to_field=tuple)
    internal: float = 1.0  # no flag


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p, Tiny)
    return p


def _actions() -> dict:
    return {a.dest: a for a in _parser()._actions}


def _parse(argv: list[str]) -> Tiny:
    return from_args(Tiny, _parser().parse_args(argv))


def test_the_flag_type_comes_from_the_annotation():
    acts = _actions()
    assert acts["count"].type is int and acts["ratio"].type is float and acts["port"].type is int
    assert acts["name"].type is None  # a str: argparse's default
    assert acts["num_threads"].type is int and acts["tags"].type is None


def test_a_field_without_a_default_is_a_required_flag():
    assert _actions()["name"].required and not _actions()["count"].required
    with pytest.raises(SystemExit):
        _parser().parse_args([])


def test_bools_are_store_true_or_a_no_flag_store_false():
    acts = _actions()
    assert isinstance(acts["verbose"], argparse._StoreTrueAction) and acts["verbose"].default is False
    assert isinstance(acts["fetch"], argparse._StoreFalseAction) and acts["fetch"].default is True
    assert isinstance(acts["no_caching"], argparse._StoreTrueAction) and acts["no_caching"].default is False
    assert _parse(["--name", "x"]) == Tiny(name="x")
    assert _parse(["--name", "x", "--verbose", "--no-fetch", "--no-caching"]) == Tiny(
        name="x", verbose=True, fetch=False, caching=False)


def test_dest_and_to_field():
    a = _parser().parse_args(["--name", "x", "--threads", "4", "--port", "-1", "--tag", "a", "--tag", "b"])
    assert a.num_threads == 4 and not hasattr(a, "threads") and a.no_caching is False
    cfg = from_args(Tiny, a)
    assert (cfg.threads, cfg.port, cfg.tags, cfg.caching) == (4, None, ("a", "b"), True)
    assert from_args(Tiny, a, count=9).count == 9  # what no flag says wins


def test_to_argv_gives_only_what_differs_and_what_is_required():
    assert to_argv(Tiny(name="x")) == ["--name", "x"]
    cfg = Tiny(name="y", count=5, ratio=0.25, port=None, verbose=True, fetch=False, caching=False, threads=2,
               tags=("a", "b"))
    argv = to_argv(cfg)
    assert argv == ["--name", "y", "--count", "5", "--ratio", "0.25", "--port", "-1", "--verbose", "--no-fetch",
                    "--no-caching", "--threads", "2", "--tag", "a", "--tag", "b"]
    assert _parse(argv) == cfg
    assert to_argv(cfg, names=["count", "port"]) == ["--count", "5", "--port", "-1"]
    assert "--name" not in to_argv(cfg, exclude=("name",))


def test_to_argv_refuses_what_its_flags_cannot_carry():
    with pytest.raises(ValueError, match=r"internal=2\.0 \(no flag\)"):
        to_argv(Tiny(name="x", internal=2.0))
    assert to_argv(Tiny(name="x", internal=2.0), exclude=("internal",)) == ["--name", "x"]  # the caller's
    with pytest.raises(ValueError, match="verbose"):  # a store_true flag cannot say False over a True default
        to_argv(_BadBool(verbose=False))
    with pytest.raises(ValueError, match="cannot say None"):
        to_argv(Tiny(name="x", count=None))
    with pytest.raises(KeyError):
        to_argv(Tiny(name="x"), names=["internal"])


@dataclasses.dataclass(frozen=True)
class _BadBool:
    verbose: bool = setting(True, flag="--verbose")  # store_true: present or absent, never False


def _router_config():
    from router.config import RouterConfig
    from router.planner.config import PlannerConfig, lease_for

    planner = PlannerConfig(mode="off", interval_s=2.0, cooldown_s=7.0, resize=True, max_prefill_nodes=3,
                            max_decode_nodes=4, min_decode_nodes=2, slo_band=(0.5, 1.0, 2.5),
                            record="/tmp/rec.jsonl", leader_lease_s=lease_for(2.0))
    return RouterConfig(redis_url="redis://:s3cr%2Ft@127.0.0.1:6390/0", model_name="m", tokenizer_dir="/tok",
                        max_model_len=512, host="0.0.0.0", ready_min_prefill=0, otlp_endpoint="http://o:4317",
                        namespace="ns", max_prompt_tokens=100, max_tokens_limit=50, short_prompt_tokens=16,
                        node_refresh_s=0.2, max_inflight=9, drain_timeout_s=5.5, prefill_deadline_factor=3.0,
                        decode_progress_floor_s=2.0, max_body_bytes=1000, max_buffered_bytes=2000,
                        http_body_timeout_s=4.0, policy="prefix_load", default_slo_class="standard",
                        prefix_fetch=False, max_migrations=0, straggler_factor=0.0, redis_timeout_s=3.0,
                        index_lookup_timeout_s=0.25, planner=planner)


def _parse_router(argv: list[str], env: dict) -> object:
    from frontend.server import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(argv), env)


def test_a_router_config_round_trips_through_its_flags():
    cfg = dataclasses.replace(_router_config(), redis_url="redis://127.0.0.1:6390/0")
    argv = to_argv(cfg, exclude=("planner",)) + to_argv(cfg.planner, exclude=("leader_lease_s",))
    assert "--redis-url" in argv and "--no-prefix-fetch" in argv and "--planner-resize" in argv
    assert _parse_router(argv, {}) == cfg


def test_the_router_process_argv_gives_back_the_routers_config():
    from deploy.router_process import router_argv

    cfg = _router_config()
    argv, env = router_argv(cfg, port=5001, http_port=None)
    assert argv[1:3] == ["-m", "frontend.server"] and "s3cr" not in " ".join(argv)
    assert _parse_router(argv[3:], env) == dataclasses.replace(cfg, port=5001, http_port=None)
    argv, env = router_argv(cfg, port=5002, http_port=8081)
    assert _parse_router(argv[3:], env) == dataclasses.replace(cfg, port=5002, http_port=8081)


def test_the_router_process_refuses_a_setting_no_flag_carries():
    from deploy.router_process import router_argv

    with pytest.raises(ValueError, match="retry_after_ms"):
        router_argv(dataclasses.replace(_router_config(), retry_after_ms=7), port=5001, http_port=None)
    with pytest.raises(ValueError, match="confirm_rounds"):
        cfg = _router_config()
        router_argv(dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, confirm_rounds=9)),
                    port=5001, http_port=None)
    with pytest.raises(ValueError, match="leader lease"):
        cfg = _router_config()
        router_argv(dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, leader_lease_s=99.0)),
                    port=5001, http_port=None)
