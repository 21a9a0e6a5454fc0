"""Bad input to the NVLink-domain options, the domain math and the runtime check's settings.

Every case must fail at once with a message naming the option (or parameter, or environment
variable) and the value at fault; CLI cases exit with 2 and print no traceback.
"""

from __future__ import annotations

import os

import pytest

from parallel_state_ng.__main__ import main
from parallel_state_ng.groups import nvlink_check
from parallel_state_ng.layout.nvlink_domains import NvlinkDomains
from tests.support.paths import ROOT

_LAYOUT = ["layout", "--world-size", "144", "--tp", "2", "--pp", "2"]
_TOPOLOGY = ["topology", os.path.join(ROOT, "docs", "mimo_topology.json"), "--release", "0.19"]

# (command line, the option named, the value named)
CLI_CASES = [
    ([*_LAYOUT, "--nvlink-domain-size", "0"], "--nvlink-domain-size", "'0'"),
    ([*_LAYOUT, "--nvlink-domain-size", "-72"], "--nvlink-domain-size", "'-72'"),
    ([*_LAYOUT, "--nvlink-domain-size", "seventy-two"], "--nvlink-domain-size", "'seventy-two'"),
    ([*_LAYOUT, "--nvlink-domain-size", "72", "--gpus-used-per-domain", "0"], "--gpus-used-per-domain", "'0'"),
    ([*_LAYOUT, "--nvlink-domain-size", "72", "--gpus-used-per-domain", "80"], "--gpus-used-per-domain", "80"),
    ([*_LAYOUT, "--gpus-used-per-domain", "64"], "--gpus-used-per-domain", "--nvlink-domain-size"),
    ([*_LAYOUT, "--suggest-order"], "--suggest-order", "--nvlink-domain-size"),
    ([*_LAYOUT, "--keep-inside", "tp,ep"], "--keep-inside", "--nvlink-domain-size"),
    ([*_LAYOUT, "--nvlink-domain-size", "72", "--keep-inside", "tp,bogus"], "--keep-inside", "'bogus'"),
    ([*_LAYOUT, "--nvlink-domain-size", "72", "--keep-inside", ","], "--keep-inside", "','"),
    ([*_LAYOUT, "--nvlink-domain-size", "72", "--top", "0"], "--top", "'0'"),
    (
        [*_LAYOUT, "--nvlink-domain-size", "72", "--gpus-used-per-domain", "36", "--gpus-per-node", "8"],
        "--gpus-per-node",
        "8 does not divide the 36 ranks",
    ),
    ([*_TOPOLOGY, "--suggest-placement"], "--suggest-placement", "--nvlink-domain-size"),
    ([*_TOPOLOGY, "--nvlink-domain-size", "4", "--keep-inside", "tensor"], "--keep-inside", "'tensor'"),
    ([*_TOPOLOGY, "--nvlink-domain-size", "4", "--gpus-used-per-domain", "5"], "--gpus-used-per-domain", "5"),
]


@pytest.mark.parametrize("argv,option,value", CLI_CASES)
def test_cli_bad_input_names_the_option_and_value(capsys, argv, option, value):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert option in err and value in err, err
    assert "Traceback" not in err


# (callable raising, exception type, the parameter or variable named, the value named)
def _domains(*args):
    return lambda: NvlinkDomains(*args)


API_CASES = [
    (_domains(0), ValueError, "domain_size", "0"),
    (_domains(True), ValueError, "domain_size", "True"),
    (_domains(72, 0), ValueError, "used_per_domain", "0"),
    (_domains(72, 73), ValueError, "used_per_domain", "73"),
    (_domains(72, "64"), ValueError, "used_per_domain", "'64'"),
]


@pytest.mark.parametrize("call,error,name,value", API_CASES)
def test_domain_math_bad_arguments_name_the_parameter(call, error, name, value):
    with pytest.raises(error) as err:
        call()
    assert name in str(err.value) and value in str(err.value)


# (environment, the variable named, the value named)
ENV_CASES = [
    ({"PSNG_NVLINK_CHECK": "loud"}, "PSNG_NVLINK_CHECK", "'loud'"),
    ({"PSNG_NVLINK_CHECK": "1"}, "PSNG_NVLINK_CHECK", "'1'"),
    ({"PSNG_NVLINK_KEEP_INSIDE": "tp,expert"}, "PSNG_NVLINK_KEEP_INSIDE", "'expert'"),
    ({"PSNG_NVLINK_DOMAIN": "  "}, "PSNG_NVLINK_DOMAIN", "empty"),
]


@pytest.mark.parametrize("env,variable,value", ENV_CASES)
def test_bad_environment_values_name_the_variable(monkeypatch, env, variable, value):
    for key in (nvlink_check.ENV_CHECK, nvlink_check.ENV_KEEP_INSIDE, nvlink_check.ENV_DOMAIN):
        monkeypatch.delenv(key, raising=False)
    for key, text in env.items():
        monkeypatch.setenv(key, text)
    with pytest.raises(ValueError) as err:
        nvlink_check.nvlink_check_settings()
        nvlink_check.local_domain_id()
    assert variable in str(err.value) and value in str(err.value)


@pytest.mark.parametrize("returned", [2.5, True, (), ("rack", 1.5), {"rack": 1}])
def test_a_source_returning_no_id_names_the_source_and_value(returned):
    previous = nvlink_check.set_nvlink_domain_source(lambda: returned)
    try:
        with pytest.raises(nvlink_check.NvlinkDomainIdError) as err:
            nvlink_check.local_domain_id()
    finally:
        nvlink_check.set_nvlink_domain_source(previous)
    assert "set_nvlink_domain_source" in str(err.value) and repr(returned) in str(err.value)


def test_a_source_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match=r"source must be a callable .* got 'rack-1'"):
        nvlink_check.set_nvlink_domain_source("rack-1")  # type: ignore[arg-type]
