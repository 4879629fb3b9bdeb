"""Server pieces that need no model: error locations, parameter mapping, CLI flags."""

from __future__ import annotations

import pytest

from radixlm.cli import main as cli_main
from radixlm.server.constraints import make_constraint
from radixlm.server.errors import ApiError, loc_to_param
from radixlm.server.server_config import ServerConfig
from radixlm.server.serving import sampling_params


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body", "temperature"), "temperature"),
        (("body", "messages", 0, "content", "str"), "messages[0].content"),
        (("body", "stop", "list[str]", 0), "stop"),
        (("body", "sampling_params", "NativeSamplingParams", "n"), "sampling_params.n"),
        (("body", "input_ids", "list[int]", 0), "input_ids"),
        (("body",), None),
        (("body", "response_format", "type"), "response_format.type"),
    ],
)
def test_loc_to_param(loc, param):
    assert loc_to_param(loc) == param


def test_sampling_params_errors_name_the_api_field():
    with pytest.raises(ApiError) as exc:
        sampling_params({"max_new_tokens": "max_tokens"}, max_new_tokens=0)
    assert exc.value.param == "max_tokens" and exc.value.message.startswith("max_tokens must")
    with pytest.raises(ApiError) as exc:
        sampling_params({}, temperature=-1.0)
    assert exc.value.param == "temperature" and exc.value.status_code == 400
    assert sampling_params({}, max_new_tokens=3).max_new_tokens == 3


def test_make_constraint_checks_shape_and_names_the_field():
    with pytest.raises(ApiError, match="not valid JSON") as exc:
        make_constraint("json_schema", "{", "sampling_params.json_schema")
    assert exc.value.param == "sampling_params.json_schema" and exc.value.status_code == 400
    with pytest.raises(ApiError, match="non-empty") as exc:
        make_constraint("regex", "", "regex")
    assert exc.value.param == "regex"
    with pytest.raises(ApiError, match="structural_tag") as exc:
        make_constraint("structural_tag", "{}", "sampling_params.structural_tag")
    assert exc.value.code == "unsupported_parameter"
    c = make_constraint("json_schema", '{"type": "object"}', "sampling_params.json_schema")
    assert c.kind == "json_schema" and c.param == "sampling_params.json_schema"
    assert c.constraint.best_effort is False and c.constraint.whitespace == "compact"
    lax = make_constraint("json_object", "", "response_format", best_effort=True, whitespace="any")
    assert lax.kind == "json_object" and lax.constraint.whitespace == "any"
    assert lax.constraint.best_effort
    assert make_constraint("regex", "[0-9]+", "regex").spec == "[0-9]+"


def test_server_config_validates():
    with pytest.raises(ValueError, match="max_n"):
        ServerConfig(max_n=0)
    with pytest.raises(ValueError, match="max_n"):
        ServerConfig(max_n=1000)


def test_serve_flags(monkeypatch):
    import radixlm.cli as cli

    seen = {}

    def fake_serve(args):
        seen["engine"] = cli.engine_kwargs(args)
        seen["server"] = cli.server_config(args)
        return 0

    monkeypatch.setattr(cli, "_serve", fake_serve)
    monkeypatch.setenv("RADIXLM_API_KEY", "from-env")
    argv = ["serve", "--port", "1234", "--max-n", "4", "--page-size", "32", "--dtype", "float32"]
    assert cli_main(argv) == 0
    assert seen["server"].port == 1234 and seen["server"].host == "127.0.0.1"
    assert seen["server"].api_key == "from-env" and seen["server"].max_n == 4
    assert seen["engine"]["page_size"] == 32 and seen["engine"]["dtype"] == "float32"
    assert seen["engine"]["model"] is None
    assert cli_main([*argv, "--api-key", "flag"]) == 0
    assert seen["server"].api_key == "flag"
    monkeypatch.delenv("RADIXLM_API_KEY")
    assert cli_main(argv) == 0
    assert seen["server"].api_key is None
    assert seen["server"].dashboard_show_text is False
    assert cli_main([*argv, "--dashboard-show-text"]) == 0
    assert seen["server"].dashboard_show_text is True


def test_bool_engine_flags_alone_mean_true(monkeypatch):
    import radixlm.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "_serve", lambda args: seen.update(cli.engine_kwargs(args)) or 0)
    assert cli_main(["serve", "--enforce-eager"]) == 0  # vLLM's spelling
    assert seen["enforce_eager"] is True
    assert cli_main(["serve", "--enforce-eager", "false"]) == 0
    assert seen["enforce_eager"] is False
    assert cli_main(["serve"]) == 0
    assert seen["enforce_eager"] is False


def test_an_impossible_tensor_parallel_split_is_one_line_not_a_traceback(capsys):
    """SmolLM2 has 9 attention heads: `--tp-size 2` is refused before any worker starts."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--tp-size", "2", "--port", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "radixlm serve: error: tp_size 2 must divide the number of attention heads (9)" in err
    assert "Traceback" not in err
