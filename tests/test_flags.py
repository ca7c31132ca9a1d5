"""Every verb's flags come from the config dataclasses: each has help text, and a verb given no flags builds each
config as the dataclass's own defaults (so --help, the configs and the docs cannot disagree)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pdserve.checkpoint import BUILTIN_MODELS
from pdserve.cli import build_parser
from pdserve.config import EngineConfig, LogConfig, NodeConfig, RouterConfig
from pdserve.flags import VERB_FLAGS, from_args
from pdserve.wire.params import Role


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _flag_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _field(config: type, name: str) -> dataclasses.Field:
    [f] = [f for f in dataclasses.fields(config) if f.name == name]
    return f


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    return build_parser()


def test_every_flag_has_help(parser):
    verbs = _subparsers(parser)
    for name, p in [("pdserve", parser), *verbs.items()]:
        for a in _flag_actions(p) + [a for a in p._actions if not a.option_strings and a.dest != "verb"]:
            assert a.help and len(a.help) > 8, f"{name} {a.option_strings or a.dest} has no help"


@pytest.mark.parametrize("verb", sorted(VERB_FLAGS))
def test_each_flag_comes_from_its_tables_config_field(parser, verb):
    """Each flag of the verb is one of its table's flags, and its help is its field's."""
    flags = {f.dest: f for _, group in VERB_FLAGS[verb] for f in group}
    actions = _flag_actions(_subparsers(parser)[verb])
    assert {a.dest for a in actions} == flags.keys(), "a flag added by hand, not from a config field"
    for a in actions:
        assert a.help.startswith(_field(flags[a.dest].config, a.dest).metadata["help"]), (verb, a.option_strings)


@pytest.mark.parametrize("verb", sorted(VERB_FLAGS))
def test_a_verb_given_no_flags_builds_each_config_with_its_defaults(parser, verb):
    """What argparse makes of each default (its type, nargs, action) is what the dataclass holds with no arguments."""
    a = parser.parse_args([verb])
    flags = [f for _, group in VERB_FLAGS[verb] for f in group]
    required = {NodeConfig: {"role": Role.PREFILL, "engine": EngineConfig()}, RouterConfig: {"colocated": ("tcp://c",)}}
    for config in {f.config for f in flags} | {LogConfig}:
        # a name two configs share (up's --cpu-cores is LaunchConfig's): the verb's code gives the other its own
        shared = {f.dest for f in flags if f.config is not config} & {f.name for f in dataclasses.fields(config)}
        given = {**{n: _field(config, n).default for n in shared}, **required.get(config, {})}
        assert from_args(config, a, **given) == config(**given), (verb, config.__name__)


def test_the_api_key_default_is_read_from_the_environment_when_the_parser_is_built(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "from-the-environment")
    assert build_parser().parse_args(["router"]).api_key == "from-the-environment"
    monkeypatch.delenv("PDSERVE_API_KEY")
    for verb in ("router", "up"):
        assert build_parser().parse_args([verb]).api_key == ""


def test_a_switchs_help_says_what_giving_it_does_and_no_default(parser):
    """A switch is off unless given: "(default: True)" on a --no-... switch would read as the opposite."""
    switches = [
        a for p in _subparsers(parser).values() for a in _flag_actions(p) if a.nargs == 0 and a.const in (True, False)
    ]
    assert {"--no-prefix-caching", "--no-access-log", "--enforce-eager"} <= {a.option_strings[0] for a in switches}
    for a in switches:
        assert "(default: True)" not in a.help and "(default: False)" not in a.help, a.option_strings


def test_help_says_defaults_and_every_built_in_model(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8000)" in text and "(default: float32)" in text
    for name in BUILTIN_MODELS:
        assert name in text
    assert "--served-model-name" in text


def test_parsed_defaults_build_the_default_configs(parser):
    """A verb run without flags gets the dataclass's own config: nothing on the way changes a default."""
    assert from_args(EngineConfig, parser.parse_args(["prefill"])) == EngineConfig()
    a = parser.parse_args(["router", "--prefill", "tcp://p", "--decode", "tcp://d", "--decode-kv", "tcp://k"])
    assert from_args(RouterConfig, a) == RouterConfig(prefill=("tcp://p",), decode=("tcp://d",), decode_kv=("tcp://k",))


def test_up_passes_its_router_flags_on(tmp_path, parser):
    from pdserve.flags import router_command, router_options

    up = parser.parse_args(
        [
            "up",
            "--served-model-name",
            "my-model",
            "--port",
            "9",
            "--max-n",
            "2",
            "--node-timeout-s",
            "3",
            "--queue-timeout-s",
            "5",
            "--api-key",
            "secret",
        ]
    )
    argv = router_command("tiny", [{"role": "colocated", "listen": "tcp://c"}], router_options(up))
    assert "secret" not in argv, "the API key travels in the router's environment, not its argv"
    router = from_args(RouterConfig, parser.parse_args(argv[3:]))
    assert (router.served_model_name, router.port, router.max_n, router.node_timeout_s, router.queue_timeout_s) == (
        "my-model",
        9,
        2,
        3.0,
        5.0,
    )


def test_no_access_log_reaches_the_router_of_up(parser):
    from pdserve.flags import router_command, router_options

    for given, logged in (([], True), (["--no-access-log"], False)):
        up = parser.parse_args(["up", *given])
        argv = router_command("tiny", [{"role": "colocated", "listen": "tcp://c"}], router_options(up))
        assert from_args(RouterConfig, parser.parse_args(argv[3:])).access_log is logged


def test_async_scheduling_defaults_by_device_and_is_passed_on_either_way(parser):
    """--async-scheduling is on by default on a cuda device, off on the cpu; given either way it wins, and a child
    node gets it as given (nothing when it was not)."""
    from pdserve.flags import engine_argv

    assert not EngineConfig().schedules_ahead and EngineConfig(device="cuda:0").schedules_ahead
    assert EngineConfig(async_scheduling=True).schedules_ahead
    assert not EngineConfig(device="cuda:0", async_scheduling=False).schedules_ahead
    for given, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        a = parser.parse_args(["decode", *given])
        assert from_args(EngineConfig, a).async_scheduling is want
        assert [x for x in engine_argv(a) if "async" in x] == given
