"""Bad input is rejected when the policy is built, with a message naming the accepted values."""

import pytest

import kvpolicy
from kvpolicy import ConfigError, Policy, UnknownNameError, preset
from kvpolicy.registry import register
from kvpolicy.triggers import QueryCosine, Trigger


def test_unknown_preset_lists_known_presets():
    with pytest.raises(UnknownNameError) as err:
        preset("louis")
    for name in kvpolicy.PRESETS:
        assert name in str(err.value)


@pytest.mark.parametrize("kind,field", [("trigger", "trigger"), ("selector", "selector"), ("units", "prefill_units")])
def test_unknown_component_lists_known_components(kind, field):
    with pytest.raises(UnknownNameError) as err:
        Policy(**{"trigger": "every_step", "prefill_units": "pages", "decode_units": "pages",
                  "selector": "top_budget", "budget": 512, field: "nope"})
    assert f"unknown {kind} 'nope'" in str(err.value)
    assert "known" in str(err.value)


@pytest.mark.parametrize("budget", [0, -5])
def test_budget_must_be_positive(budget):
    with pytest.raises(ConfigError, match="budget must be a positive integer"):
        preset("quest", budget=budget)


def test_budget_below_sink_plus_local():
    with pytest.raises(ConfigError, match="sink \\+ local = 4 \\+ 64 = 68"):
        preset("louiskv", budget=60)
    with pytest.raises(ConfigError, match="must exceed"):
        preset("louiskv", budget=68)


@pytest.mark.parametrize("tau", [1.5, -1.01, float("nan")])
def test_tau_outside_range(tau):
    with pytest.raises(ConfigError, match=r"tau must be a number in \[-1, 1\]"):
        preset("louiskv", trigger={"name": "query_cosine", "tau": tau})
    with pytest.raises(ConfigError):
        Policy(trigger=QueryCosine(tau=tau), prefill_units="kmeans", decode_units="segments",
               selector="top_budget", budget=512)


def test_tau_at_the_ends_is_accepted():
    for tau in (-1.0, 1.0):
        assert preset("louiskv", trigger={"name": "query_cosine", "tau": tau}).trigger.tau == tau


def test_unknown_option_names_the_options():
    with pytest.raises(ConfigError, match="has no option.*tua.*its options: against, tau"):
        preset("louiskv", trigger={"name": "query_cosine", "tua": 0.5})


def test_builder_roles_are_checked():
    with pytest.raises(ConfigError, match="cannot group generated tokens"):
        Policy(trigger="every_step", prefill_units="kmeans", decode_units="kmeans", selector="top_budget", budget=512)
    with pytest.raises(ConfigError, match="cannot group the prompt"):
        Policy(trigger="every_step", prefill_units="segments", decode_units="segments", selector="top_budget", budget=512)


def test_placement_and_backend_values():
    with pytest.raises(ConfigError, match="accepted: cpu, gpu"):
        preset("quest", placement="nvme")
    with pytest.raises(ConfigError, match="accepted: auto, reference, triton"):
        preset("quest", backend="cuda")
    with pytest.raises(ConfigError, match="unknown admit 'drop'; accepted: room, evict"):
        preset("quest", admit="drop")


def test_admit_is_in_the_spec_only_when_it_evicts():
    # a spec at admit="room" keeps the key set it had before the option existed (eval cells resume)
    assert "admit" not in preset("clusterkv", admit="room").to_dict()
    evicting = preset("clusterkv", admit="evict")
    assert evicting.to_dict()["admit"] == "evict"
    assert Policy.from_dict(evicting.to_dict()) == evicting


def test_from_dict_round_trip_and_unknown_fields():
    policy = preset("louiskv", budget=1024)
    again = Policy.from_dict(policy.to_dict())
    assert again == policy
    assert Policy.from_dict({"preset": "quest", "budget": 256}).budget == 256
    with pytest.raises(ConfigError, match="unknown policy field.*budgt"):
        Policy.from_dict({"preset": "quest", "budgt": 256})


def test_register_rejects_a_name_taken_by_another_class():
    with pytest.raises(ConfigError, match="already registered"):
        @register("trigger", "every_step")
        class Impostor(Trigger):
            pass
